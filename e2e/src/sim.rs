//! Simulated GPU nodes and GPU pods. KWOK manages every node that carries
//! `kwok.x-k8s.io/node=fake`: it reports the node Ready, keeps its lease and
//! runs the pods bound to it.

use std::collections::BTreeMap;

use gpuhealth_api::contract::GPU_HEALTHY_READINESS_GATE;
use k8s_openapi::{
    api::{
        apps::v1::{Deployment, DeploymentSpec},
        core::v1::{
            Container, HTTPGetAction, Node, NodeCondition, NodeSpec, NodeStatus, NodeSystemInfo,
            Pod, PodCondition, PodReadinessGate, PodSpec, PodTemplateSpec, Probe,
            ResourceRequirements, Toleration,
        },
    },
    apimachinery::pkg::{
        api::resource::Quantity,
        apis::meta::v1::{LabelSelector, ObjectMeta},
        util::intstr::IntOrString,
    },
};

/// The extended resource the NVIDIA device plugin advertises.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";
/// KWOK manages nodes with this annotation.
pub const KWOK_ANNOTATION: (&str, &str) = ("kwok.x-k8s.io/node", "fake");
/// Label every simulated GPU node carries, with the group it was made in.
pub const SIM_GROUP_LABEL: &str = "gpuhealth.io/sim-group";
/// The GPU product label set by NVIDIA's GPU feature discovery.
pub const PRODUCT_LABEL: &str = "nvidia.com/gpu.product";

/// A simulated GPU node as a cloud provider would register it.
#[derive(Clone, Debug)]
pub struct GpuNodeSpec {
    pub gpus: u32,
    pub product: String,
    pub labels: BTreeMap<String, String>,
    /// Whether a device plugin offers the GPUs as `nvidia.com/gpu`; a DRA
    /// node offers them as devices in a ResourceSlice instead (`dra`).
    pub device_plugin: bool,
}

impl Default for GpuNodeSpec {
    fn default() -> Self {
        // The incident's node: eight RTX 5090 D cards.
        GpuNodeSpec {
            gpus: 8,
            product: "NVIDIA-GeForce-RTX-5090-D".into(),
            labels: BTreeMap::new(),
            device_plugin: true,
        }
    }
}

/// A KWOK-managed node named `name` in simulation group `group`.
pub fn gpu_node(name: &str, group: &str, spec: &GpuNodeSpec) -> Node {
    let mut labels = spec.labels.clone();
    labels.extend([
        (SIM_GROUP_LABEL.to_owned(), group.to_owned()),
        ("kubernetes.io/hostname".to_owned(), name.to_owned()),
        ("kubernetes.io/os".to_owned(), "linux".to_owned()),
        ("kubernetes.io/arch".to_owned(), "amd64".to_owned()),
        (
            "node.kubernetes.io/instance-type".to_owned(),
            "gpu-8x".to_owned(),
        ),
        (PRODUCT_LABEL.to_owned(), spec.product.clone()),
        ("nvidia.com/gpu.count".to_owned(), spec.gpus.to_string()),
        ("nvidia.com/gpu.present".to_owned(), "true".to_owned()),
    ]);
    kwok_node(name, labels, spec.device_plugin.then_some(spec.gpus))
}

/// A KWOK-managed node without GPUs (where the operator's own pods go), in
/// simulation group `group`.
pub fn cpu_node(name: &str, group: &str) -> Node {
    let labels = BTreeMap::from([
        (SIM_GROUP_LABEL.to_owned(), group.to_owned()),
        ("kubernetes.io/hostname".to_owned(), name.to_owned()),
        ("kubernetes.io/os".to_owned(), "linux".to_owned()),
        ("kubernetes.io/arch".to_owned(), "amd64".to_owned()),
    ]);
    kwok_node(name, labels, None)
}

fn kwok_node(name: &str, labels: BTreeMap<String, String>, gpus: Option<u32>) -> Node {
    let mut resources = BTreeMap::from([
        ("cpu".to_owned(), Quantity("96".into())),
        ("memory".to_owned(), Quantity("1024Gi".into())),
        ("pods".to_owned(), Quantity("110".into())),
    ]);
    if let Some(gpus) = gpus {
        resources.insert(GPU_RESOURCE.to_owned(), Quantity(gpus.to_string()));
    }
    Node {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(labels),
            annotations: Some(BTreeMap::from([(
                KWOK_ANNOTATION.0.to_owned(),
                KWOK_ANNOTATION.1.to_owned(),
            )])),
            ..Default::default()
        },
        spec: Some(NodeSpec::default()),
        status: Some(NodeStatus {
            allocatable: Some(resources.clone()),
            capacity: Some(resources),
            node_info: Some(NodeSystemInfo {
                boot_id: format!("boot-{name}-1"),
                architecture: "amd64".into(),
                operating_system: "linux".into(),
                ..Default::default()
            }),
            ..Default::default()
        }),
    }
}

/// A Deployment of pods that each hold `gpus_per_pod` GPUs, pinned to the
/// nodes of simulation group `group`.
pub fn gpu_deployment(
    namespace: &str,
    name: &str,
    group: &str,
    replicas: i32,
    gpus_per_pod: u32,
) -> Deployment {
    let labels = BTreeMap::from([("app".to_owned(), name.to_owned())]);
    let gpus = BTreeMap::from([(GPU_RESOURCE.to_owned(), Quantity(gpus_per_pod.to_string()))]);
    Deployment {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            namespace: Some(namespace.to_owned()),
            ..Default::default()
        },
        spec: Some(DeploymentSpec {
            replicas: Some(replicas),
            selector: LabelSelector {
                match_labels: Some(labels.clone()),
                ..Default::default()
            },
            template: PodTemplateSpec {
                metadata: Some(ObjectMeta {
                    labels: Some(labels),
                    ..Default::default()
                }),
                spec: Some(PodSpec {
                    node_selector: Some(BTreeMap::from([(
                        SIM_GROUP_LABEL.to_owned(),
                        group.to_owned(),
                    )])),
                    tolerations: Some(vec![Toleration {
                        key: Some(GPU_RESOURCE.to_owned()),
                        operator: Some("Exists".into()),
                        effect: Some("NoSchedule".into()),
                        ..Default::default()
                    }]),
                    // Simulated pods hold nothing worth a long goodbye.
                    termination_grace_period_seconds: Some(1),
                    containers: vec![Container {
                        name: "server".into(),
                        image: Some("vllm/vllm-openai:latest".into()),
                        resources: Some(ResourceRequirements {
                            limits: Some(gpus.clone()),
                            requests: Some(gpus),
                            ..Default::default()
                        }),
                        ..Default::default()
                    }],
                    ..Default::default()
                }),
            },
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// The incident's vLLM startup probe on every container: 30 s delay, then
/// 30 tries 10 s apart, a 330 s window against a 600–800 s cold start.
pub fn with_incident_startup_probe(deployment: &mut Deployment) {
    for c in pod_spec(deployment)
        .map(|s| s.containers.iter_mut())
        .into_iter()
        .flatten()
    {
        c.startup_probe = Some(Probe {
            http_get: Some(HTTPGetAction {
                path: Some("/health".into()),
                port: IntOrString::Int(8000),
                ..Default::default()
            }),
            initial_delay_seconds: Some(30),
            period_seconds: Some(10),
            timeout_seconds: Some(5),
            failure_threshold: Some(30),
            ..Default::default()
        });
    }
}

/// Pods of `deployment` list the readiness gate `gpuhealth.io/gpu-healthy`.
pub fn with_gpu_gate(deployment: &mut Deployment) {
    if let Some(spec) = pod_spec(deployment) {
        spec.readiness_gates = Some(vec![PodReadinessGate {
            condition_type: GPU_HEALTHY_READINESS_GATE.into(),
        }]);
    }
}

/// Pods of `deployment` carry `key: value`.
pub fn with_pod_annotation(deployment: &mut Deployment, (key, value): (&str, &str)) {
    if let Some(meta) = deployment
        .spec
        .as_mut()
        .and_then(|s| s.template.metadata.as_mut())
    {
        meta.annotations
            .get_or_insert_default()
            .insert(key.into(), value.into());
    }
}

fn pod_spec(deployment: &mut Deployment) -> Option<&mut PodSpec> {
    deployment.spec.as_mut()?.template.spec.as_mut()
}

/// Whether a node reports `Ready=True`.
pub fn node_is_ready(node: &Node) -> bool {
    let conditions: &[NodeCondition] = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default();
    conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

/// Whether a pod reports `Ready=True`.
pub fn pod_is_ready(pod: &Pod) -> bool {
    let conditions: &[PodCondition] = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_deref())
        .unwrap_or_default();
    conditions
        .iter()
        .any(|c| c.type_ == "Ready" && c.status == "True")
}

/// Whether the node is cordoned (`spec.unschedulable`).
pub fn is_cordoned(node: &Node) -> bool {
    node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true)
}

/// Cordons or uncordons `node`, as `kubectl cordon` does: a person's or
/// another tool's, never gpuhealth's (which records itself as the owner).
/// Whether `node` is ever cordoned from now on, from a watch that runs
/// until the returned task is dropped.
pub fn watch_cordon(
    client: &kube::Client,
    node: &str,
) -> (
    crate::wait::Background,
    std::sync::Arc<std::sync::atomic::AtomicBool>,
) {
    use futures::StreamExt;
    let ever = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let seen = ever.clone();
    let config = kube::runtime::watcher::Config::default().fields(&format!("metadata.name={node}"));
    let nodes: kube::Api<Node> = kube::Api::all(client.clone());
    let task = crate::wait::Background::spawn(async move {
        let mut stream = std::pin::pin!(crate::wait::applied(nodes, config));
        while let Some(n) = stream.next().await {
            if is_cordoned(&n) {
                seen.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
    });
    (task, ever)
}

pub async fn set_cordon(client: &kube::Client, node: &str, on: bool) -> kube::Result<()> {
    kube::Api::<Node>::all(client.clone())
        .patch(
            node,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({"spec": {"unschedulable": on}})),
        )
        .await
        .map(|_| ())
}

/// The `nvidia` RuntimeClass, as the GPU Operator creates it on a cluster it
/// runs on: the agent's default install (`config/agent/container-toolkit`)
/// names it, and the API server refuses pods whose RuntimeClass is missing.
pub async fn gpu_operator_runtime_class(client: &kube::Client) -> kube::Result<()> {
    let class = k8s_openapi::api::node::v1::RuntimeClass {
        metadata: ObjectMeta {
            name: Some("nvidia".into()),
            ..Default::default()
        },
        handler: "nvidia".into(),
        ..Default::default()
    };
    match kube::Api::all(client.clone())
        .create(&kube::api::PostParams::default(), &class)
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) if e.code == 409 => Ok(()),
        Err(e) => Err(e),
    }
}

/// A Ready simulated eight-GPU node, named `unique(prefix)`, in a
/// simulation group of its own.
pub async fn ready_gpu_node(client: &kube::Client, prefix: &str) -> crate::Result<String> {
    let node = crate::unique(prefix);
    let api: kube::Api<Node> = kube::Api::all(client.clone());
    api.create(
        &kube::api::PostParams::default(),
        &gpu_node(&node, &node, &GpuNodeSpec::default()),
    )
    .await?;
    crate::wait::until(api, &node, crate::wait::WAIT, node_is_ready).await?;
    Ok(node)
}

/// Removes a test's node (one left with a broken GPU in its report would be
/// remediated by the operators of later tests) and its `GpuNodeHealth`.
pub async fn remove_node(client: &kube::Client, node: &str) {
    let _ = kube::Api::<Node>::all(client.clone())
        .delete(node, &Default::default())
        .await;
    let _ = kube::Api::<gpuhealth_api::GpuNodeHealth>::all(client.clone())
        .delete(node, &Default::default())
        .await;
}
