//! Simulated Dynamic Resource Allocation: a DRA driver's ResourceSlice per
//! simulated node (one device per GPU, named `gpu-<index>`, with the UUID,
//! index and PCI address NVIDIA's driver publishes), its DeviceClass, and
//! pods that claim one GPU. The real scheduler allocates the claims and
//! KWOK runs the pods: nothing here decides which device a pod gets.

use std::collections::BTreeMap;

use gpuhealth_api::{
    contract::GpuReport,
    device_taint_rule::{self, DeviceTaintRule, RuleVersion},
};
use k8s_openapi::{
    api::{
        core::v1::{
            Container, Pod, PodResourceClaim, PodSpec, ResourceClaim as ContainerClaim,
            ResourceRequirements,
        },
        resource::v1::{
            CELDeviceSelector, Device, DeviceAttribute, DeviceClaim, DeviceClass, DeviceClassSpec,
            DeviceRequest, DeviceSelector, ExactDeviceRequest, ResourceClaim, ResourceClaimSpec,
            ResourcePool, ResourceSlice, ResourceSliceSpec,
        },
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{
    Api, Client,
    api::{Patch, PatchParams, PostParams},
};

use crate::{HarnessError, Result, sim::SIM_GROUP_LABEL};

/// The driver NVIDIA's DRA driver registers for whole GPUs.
pub const DRIVER: &str = "gpu.nvidia.com";
/// The DeviceClass that selects its devices.
pub const CLASS: &str = "gpu.nvidia.com";

/// A device's name on its node.
pub fn device_name(index: u32) -> String {
    format!("gpu-{index}")
}

/// The DeviceClass of the driver's GPUs; made once per cluster.
pub async fn ensure_device_class(client: &Client) -> Result<()> {
    let class = DeviceClass {
        metadata: ObjectMeta {
            name: Some(CLASS.into()),
            ..Default::default()
        },
        spec: DeviceClassSpec {
            selectors: Some(vec![DeviceSelector {
                cel: Some(CELDeviceSelector {
                    expression: format!("device.driver == '{DRIVER}'"),
                }),
            }]),
            ..Default::default()
        },
    };
    let api: Api<DeviceClass> = Api::all(client.clone());
    api.patch(
        CLASS,
        &PatchParams::apply("gpuhealth-e2e").force(),
        &Patch::Apply(&class),
    )
    .await?;
    Ok(())
}

/// Publishes `node`'s GPUs, as `report` lists them, as the driver's pool.
pub async fn publish(client: &Client, node: &str, report: &GpuReport) -> Result<()> {
    let devices = report
        .gpus
        .iter()
        .map(|g| Device {
            name: device_name(g.index),
            attributes: Some(BTreeMap::from([
                ("uuid".to_owned(), string(&g.uuid)),
                (
                    "index".to_owned(),
                    DeviceAttribute {
                        int: Some(i64::from(g.index)),
                        ..Default::default()
                    },
                ),
                (
                    "productName".to_owned(),
                    string(g.product.as_deref().unwrap_or("NVIDIA GPU")),
                ),
                (
                    "resource.kubernetes.io/pciBusID".to_owned(),
                    string(
                        &g.pci_bus_id
                            .to_lowercase()
                            .replacen("00000000:", "0000:", 1),
                    ),
                ),
            ])),
            ..Default::default()
        })
        .collect();
    let slice = ResourceSlice {
        metadata: ObjectMeta {
            name: Some(format!("{node}-{DRIVER}")),
            ..Default::default()
        },
        spec: ResourceSliceSpec {
            driver: DRIVER.into(),
            node_name: Some(node.into()),
            pool: ResourcePool {
                name: node.into(),
                generation: 1,
                resource_slice_count: 1,
            },
            devices: Some(devices),
            ..Default::default()
        },
    };
    Api::<ResourceSlice>::all(client.clone())
        .create(&PostParams::default(), &slice)
        .await?;
    Ok(())
}

fn string(s: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(s.to_owned()),
        ..Default::default()
    }
}

/// A pod in `namespace` on a node of simulation group `group` that claims
/// one GPU through ResourceClaim `<name>-gpu` (created here): GPU `index`
/// if given, else any the scheduler finds free.
pub async fn claiming_pod(
    client: &Client,
    namespace: &str,
    group: &str,
    name: &str,
    index: Option<u32>,
) -> Result<()> {
    claiming_pod_where(client, namespace, (SIM_GROUP_LABEL, group), name, index).await
}

/// Like [`claiming_pod`], on node `node` only.
pub async fn claiming_pod_on(
    client: &Client,
    namespace: &str,
    node: &str,
    name: &str,
    index: Option<u32>,
) -> Result<()> {
    let on = ("kubernetes.io/hostname", node);
    claiming_pod_where(client, namespace, on, name, index).await
}

/// A claiming pod whose node carries `label`.
async fn claiming_pod_where(
    client: &Client,
    namespace: &str,
    label: (&str, &str),
    name: &str,
    index: Option<u32>,
) -> Result<()> {
    let claim_name = format!("{name}-gpu");
    let claim = ResourceClaim {
        metadata: ObjectMeta {
            name: Some(claim_name.clone()),
            namespace: Some(namespace.into()),
            ..Default::default()
        },
        spec: ResourceClaimSpec {
            devices: Some(DeviceClaim {
                requests: Some(vec![DeviceRequest {
                    name: "gpu".into(),
                    exactly: Some(ExactDeviceRequest {
                        device_class_name: CLASS.into(),
                        count: Some(1),
                        selectors: index.map(|i| {
                            vec![DeviceSelector {
                                cel: Some(CELDeviceSelector {
                                    expression: format!(
                                        "device.attributes['{DRIVER}'].index == {i}"
                                    ),
                                }),
                            }]
                        }),
                        ..Default::default()
                    }),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
        },
        status: None,
    };
    Api::<ResourceClaim>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &claim)
        .await?;
    let pod = Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            labels: Some(BTreeMap::from([("app".to_owned(), "dra".to_owned())])),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_selector: Some(BTreeMap::from([(label.0.to_owned(), label.1.to_owned())])),
            termination_grace_period_seconds: Some(1),
            resource_claims: Some(vec![PodResourceClaim {
                name: "gpu".into(),
                resource_claim_name: Some(claim_name),
                ..Default::default()
            }]),
            containers: vec![Container {
                name: "server".into(),
                image: Some("vllm/vllm-openai:latest".into()),
                resources: Some(ResourceRequirements {
                    claims: Some(vec![ContainerClaim {
                        name: "gpu".into(),
                        ..Default::default()
                    }]),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: None,
    };
    Api::<Pod>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &pod)
        .await?;
    Ok(())
}

/// The device pod `pod`'s claim (`<pod>-gpu`, as [`claiming_pod`] makes
/// it) was allocated, once the scheduler has allocated it.
pub async fn device_of(client: &Client, namespace: &str, pod: &str) -> Result<String> {
    let claims: Api<ResourceClaim> = Api::namespaced(client.clone(), namespace);
    let claim = crate::wait::until(claims, &format!("{pod}-gpu"), crate::wait::WAIT, |c| {
        allocated_device(c).is_some()
    })
    .await?;
    Ok(allocated_device(&claim).unwrap_or_default())
}

/// The version of `resource.k8s.io` this cluster's DeviceTaintRules are
/// read and written in: the newest it serves, as the operator chooses it;
/// None where it serves none. Asked once per test binary (which runs
/// against one cluster); an error is not taken for an answer.
pub async fn served_rule_version(client: &Client) -> Result<Option<RuleVersion>> {
    static CHOSEN: tokio::sync::OnceCell<Option<RuleVersion>> = tokio::sync::OnceCell::const_new();
    let chosen = CHOSEN
        .get_or_try_init(|| {
            RuleVersion::choose(|group_version: String| async move {
                match client.list_api_group_resources(&group_version).await {
                    Ok(list) => Ok(list
                        .resources
                        .iter()
                        .any(|r| r.name == device_taint_rule::PLURAL)),
                    Err(kube::Error::Api(status)) if status.code == 404 => Ok(false),
                    Err(e) => Err(HarnessError::from(e)),
                }
            })
        })
        .await?;
    Ok(*chosen)
}

/// [`served_rule_version`], for a test that needs one.
pub async fn rule_version(client: &Client) -> Result<RuleVersion> {
    served_rule_version(client)
        .await?
        .ok_or_else(|| HarnessError::Invalid("the cluster serves no DeviceTaintRules".into()))
}

/// DeviceTaintRules, in [`rule_version`].
pub async fn rules(client: &Client) -> Result<Api<DeviceTaintRule>> {
    Ok(Api::all_with(client.clone(), &rule_version(client).await?))
}

/// For a watcher that must not miss a rule: DeviceTaintRules in the
/// version the cluster serves, asked again until it answers (an API server
/// restarting); None only where it serves none.
pub async fn rules_once_answered(client: &Client) -> Option<Api<DeviceTaintRule>> {
    loop {
        match served_rule_version(client).await {
            Ok(version) => return version.map(|v| Api::all_with(client.clone(), &v)),
            Err(e) => {
                eprintln!("asking which DeviceTaintRules are served (retrying): {e}");
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
        }
    }
}

/// Deletes every DeviceTaintRule of gpuhealth's for `node` (an identity
/// that holds break glass may).
pub async fn delete_fences(client: &Client, node: &str) -> Result<()> {
    let of_node = kube::api::ListParams::default().labels(&format!(
        "{}={node}",
        gpuhealth_api::quarantine::RULE_NODE_LABEL
    ));
    rules(client)
        .await?
        .delete_collection(&Default::default(), &of_node)
        .await?;
    Ok(())
}

/// The device (`gpu-<index>`) a pod's claim `<pod>-gpu` was allocated, once
/// it was.
pub fn allocated_device(claim: &ResourceClaim) -> Option<String> {
    claim
        .status
        .as_ref()?
        .allocation
        .as_ref()?
        .devices
        .as_ref()?
        .results
        .as_ref()?
        .first()
        .map(|r| r.device.clone())
}
