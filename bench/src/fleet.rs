//! The simulated fleet: KWOK nodes with eight GPUs, one bare pod bound to
//! each GPU and a few CPU pods (bound by `nodeName`: the scheduler is not
//! what is measured), and on each node the GPU report that names its pods.

use std::time::Instant;

use futures::{StreamExt, TryStreamExt, future::try_join_all, stream};
use gpuhealth_api::{
    GpuNodeHealth,
    contract::{AnnotationValue, CORDONED_BY_ANNOTATION, GPU_REPORT_ANNOTATION, GpuReport},
    node_health::Phase,
    vocabulary::IncidentOutcome,
};
use gpuhealth_e2e::{
    agent::write_report,
    reports,
    sim::{GPU_RESOURCE, GpuNodeSpec, gpu_node},
    wait,
};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::{
    Api, Client, ResourceExt,
    api::{Patch, PatchParams, PostParams},
    runtime::watcher,
};
use serde_json::json;

use crate::Result;

/// The simulation group of every bench node, and the namespace of its pods.
pub const GROUP: &str = "bench";
pub const NAMESPACE: &str = "bench";
/// How long a set of incidents may take to recover before the run is
/// called failed.
const RECOVERY: std::time::Duration = std::time::Duration::from_secs(900);
/// Requests in flight while building the fleet.
const CONCURRENCY: usize = 32;

pub fn node_name(i: usize) -> String {
    format!("gpu-{i:05}")
}

pub async fn namespace(client: &Client) -> Result<()> {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NAMESPACE}}))?;
    match Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
    {
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        other => other.map(|_| ()).map_err(Into::into),
    }
}

/// What runs on a new node.
#[derive(Clone, Copy, Debug)]
pub enum Workload {
    /// One pod on each GPU and `cpu_pods` more that hold no GPU.
    Busy { cpu_pods: usize },
    /// No pods: every GPU free (the large fleet, which KWOK could not
    /// keep running pods for on two cores).
    Idle,
}

/// Nodes `from..to`, each with its pods and its report.
pub async fn grow(client: &Client, from: usize, to: usize, workload: Workload) -> Result<()> {
    stream::iter(from..to)
        .map(|i| add_node(client, node_name(i), workload))
        .buffer_unordered(CONCURRENCY)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

async fn add_node(client: &Client, name: String, workload: Workload) -> Result<()> {
    Api::<Node>::all(client.clone())
        .create(
            &PostParams::default(),
            &gpu_node(&name, GROUP, &GpuNodeSpec::default()),
        )
        .await?;
    let gpu_pods: Vec<String> = match workload {
        Workload::Busy { cpu_pods } => {
            let gpu_pods: Vec<String> = (0..8).map(|g| format!("{name}-gpu{g}")).collect();
            for pod in &gpu_pods {
                create_pod(client, &name, pod, true).await?;
            }
            add_cpu_pods(client, &name, 0, cpu_pods).await?;
            gpu_pods
        }
        Workload::Idle => Vec::new(),
    };
    write_report(client, &name, reports::healthy(NAMESPACE, &gpu_pods)).await?;
    Ok(())
}

/// CPU pods `from..to` on `node`: pods that hold no GPU.
pub async fn add_cpu_pods(client: &Client, node: &str, from: usize, to: usize) -> Result<()> {
    for i in from..to {
        create_pod(client, node, &format!("{node}-cpu{i}"), false).await?;
    }
    Ok(())
}

/// `add_cpu_pods` on many nodes at once.
pub async fn add_cpu_pods_everywhere(
    client: &Client,
    nodes: &[String],
    from: usize,
    to: usize,
) -> Result<()> {
    stream::iter(nodes)
        .map(|n| add_cpu_pods(client, n, from, to))
        .buffer_unordered(CONCURRENCY)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(())
}

async fn create_pod(client: &Client, node: &str, name: &str, gpu: bool) -> Result<()> {
    let resources = if gpu {
        json!({"limits": {GPU_RESOURCE: "1"}})
    } else {
        json!({"requests": {"cpu": "100m"}})
    };
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app": "bench"}},
        "spec": {
            "nodeName": node,
            // The storm measures gpuhealth, not the pods' own shutdown.
            "terminationGracePeriodSeconds": 1,
            "containers": [{"name": "server", "image": "bench", "resources": resources}],
        },
    }))?;
    match Api::<Pod>::namespaced(client.clone(), NAMESPACE)
        .create(&PostParams::default(), &pod)
        .await
    {
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(()),
        other => other.map(|_| ()).map_err(Into::into),
    }
}

/// Breaks GPU 7 of `node` as in the incident (Xid 119, then 154: reset
/// required) and returns when the API server answered the write.
pub async fn break_gpu(client: &Client, node: &str) -> Result<Instant> {
    let mut report = report_of(client, node).await?;
    reports::xid_119_and_154(&mut report, 7);
    write_report(client, node, report).await?;
    Ok(Instant::now())
}

/// Sets (`Some`) or removes (`None`) label `key` on each of `nodes`.
pub async fn label(
    client: &Client,
    nodes: &[String],
    key: &str,
    value: Option<&str>,
) -> Result<()> {
    let api = Api::<Node>::all(client.clone());
    let patch = Patch::Merge(json!({"metadata": {"labels": {key: value}}}));
    let params = PatchParams::default();
    try_join_all(nodes.iter().map(|n| api.patch(n, &params, &patch))).await?;
    Ok(())
}

/// After the floor's run: the node's GPUs healthy again and its cordon gone.
pub async fn restore(client: &Client, node: &str) -> Result<()> {
    let mut report = report_of(client, node).await?;
    for gpu in &mut report.gpus {
        gpu.health = gpuhealth_api::GpuHealth::Healthy;
        gpu.recovery_action = Some(0);
        gpu.xids.clear();
    }
    write_report(client, node, report).await?;
    let patch = json!({
        "metadata": {"annotations": {CORDONED_BY_ANNOTATION: null}},
        "spec": {"unschedulable": false},
    });
    Api::<Node>::all(client.clone())
        .patch(node, &PatchParams::default(), &Patch::Merge(patch))
        .await?;
    Ok(())
}

async fn report_of(client: &Client, node: &str) -> Result<GpuReport> {
    let node = Api::<Node>::all(client.clone()).get(node).await?;
    let value = node
        .annotations()
        .get(GPU_REPORT_ANNOTATION)
        .cloned()
        .unwrap_or_default();
    Ok(GpuReport::parse(&value).map_err(|e| format!("{}: {e}", node.name_any()))?)
}

/// Waits until every node of `nodes` has recovered from its incident.
pub async fn recovered(client: &Client, nodes: &[String]) -> Result<()> {
    let what = format!("{} nodes recovered", nodes.len());
    wait::until_set(
        Api::<GpuNodeHealth>::all(client.clone()),
        watcher::Config::default(),
        &what,
        RECOVERY,
        |all| {
            nodes.iter().all(|n| {
                all.get(n).and_then(|h| h.status.as_ref()).is_some_and(|s| {
                    s.phase == Phase::Healthy
                        && s.history
                            .first()
                            .is_some_and(|i| i.outcome == Some(IncidentOutcome::Recovered))
                })
            })
        },
    )
    .await?;
    Ok(())
}
