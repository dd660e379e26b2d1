//! The kubelet's health of the devices it gave each pod
//! (`allocatedResourcesStatus` in the pod's container statuses): one watch
//! of every pod that keeps only the pods holding a device the kubelet calls
//! `Unhealthy`, so that it costs memory only while one is.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::Arc,
};

use futures::{StreamExt, channel::mpsc::UnboundedSender};
use gpuhealth_api::{quarantine::Quarantine, vocabulary::DeviceId};
use gpuhealth_engine::{
    diagnosis::{HeldDevice, UnhealthyDevice},
    fence::DeviceView,
};
use k8s_openapi::{
    api::{
        core::v1::{Node, Pod},
        resource::v1::ResourceClaim,
    },
    jiff::Timestamp,
};
use kube::{
    Api, Client, ResourceExt,
    runtime::{
        WatchStreamExt,
        reflector::{ObjectRef, Store},
        watcher::{self, Event},
    },
};
use parking_lot::{Mutex, MutexGuard};
use tracing::warn;

use crate::devices;

/// The kubelet's word for a device that is not well.
const UNHEALTHY: &str = "Unhealthy";

/// Per node, per pod UID, the devices it holds that the kubelet calls
/// unhealthy.
type ByNode = BTreeMap<String, BTreeMap<String, Holder>>;

#[derive(Default)]
pub struct PodHealth {
    by_node: Mutex<ByNode>,
}

/// A pod holding a device the kubelet calls unhealthy.
#[derive(Clone, Debug, PartialEq)]
struct Holder {
    namespace: String,
    name: String,
    devices: Vec<Held>,
}

#[derive(Clone, Debug, PartialEq)]
struct Held {
    resource: Resource,
    /// The kubelet's id for it: a device plugin's device id, or for DRA
    /// `driver/pool/device` (or the device's first CDI id, where it has one).
    id: String,
    message: Option<String>,
    since: Timestamp,
}

/// What the pod asked for that the device came from.
#[derive(Clone, Debug, PartialEq)]
enum Resource {
    /// An extended resource of a device plugin (`nvidia.com/gpu`).
    Plugin(String),
    /// A ResourceClaim, by its name when the pod says it.
    Claim(Option<String>),
}

/// Starts the watch; a change in what a node's pods hold unhealthy is sent
/// as that node.
pub fn watch(client: Client, changed: UnboundedSender<ObjectRef<Node>>) -> Arc<PodHealth> {
    let health = Arc::new(PodHealth::default());
    let kept = health.clone();
    tokio::spawn(async move {
        // Pages of 50: a list of every pod is read once at start (and after
        // a watch falls too far behind), and 500 whole pods at a time left
        // the operator 12 MiB bigger for good at 1,000 pods.
        let config = watcher::Config::default().page_size(50);
        let mut events =
            std::pin::pin!(watcher::watcher(Api::<Pod>::all(client), config).default_backoff());
        let mut relisting: Option<ByNode> = None;
        while let Some(event) = events.next().await {
            let woken = match event {
                Ok(Event::Init) => {
                    relisting = Some(ByNode::new());
                    Vec::new()
                }
                Ok(Event::InitApply(pod)) => {
                    if let Some(listed) = relisting.as_mut() {
                        kept.relisted(listed, &pod);
                    }
                    Vec::new()
                }
                Ok(Event::InitDone) => relisting
                    .take()
                    .map(|listed| kept.replace(listed))
                    .unwrap_or_default(),
                Ok(Event::Apply(pod)) => kept.apply(&pod, Timestamp::now()).into_iter().collect(),
                Ok(Event::Delete(pod)) => kept.remove(&pod).into_iter().collect(),
                Err(e) => {
                    warn!(error = %e, "the watch of pods failed; it starts again");
                    Vec::new()
                }
            };
            for node in woken {
                let _ = changed.unbounded_send(ObjectRef::new(&node));
            }
        }
    });
    health
}

impl PodHealth {
    fn lock(&self) -> MutexGuard<'_, ByNode> {
        self.by_node.lock()
    }

    /// A pod as the watch saw it change at `now`: its node, if what it
    /// holds unhealthy changed.
    fn apply(&self, pod: &Pod, now: Timestamp) -> Option<String> {
        let (node, uid) = (node_of(pod)?, pod.uid()?);
        let mut by_node = self.lock();
        let before = by_node.get(&node).and_then(|pods| pods.get(&uid));
        let after = holder(pod, before, now);
        if before == after.as_ref() {
            return None;
        }
        let pods = by_node.entry(node.clone()).or_default();
        match after {
            Some(h) => pods.insert(uid, h),
            None => pods.remove(&uid),
        };
        if pods.is_empty() {
            by_node.remove(&node);
        }
        Some(node)
    }

    /// A pod gone: its node, if it held anything unhealthy.
    fn remove(&self, pod: &Pod) -> Option<String> {
        let (node, uid) = (node_of(pod)?, pod.uid()?);
        let mut by_node = self.lock();
        let pods = by_node.get_mut(&node)?;
        pods.remove(&uid)?;
        if pods.is_empty() {
            by_node.remove(&node);
        }
        Some(node)
    }

    /// A pod of a (re)list: a device already known keeps when it was first
    /// seen; one not known may have turned while no watch looked, so it
    /// counts from the pod's start, the earliest it can have turned.
    fn relisted(&self, listed: &mut ByNode, pod: &Pod) {
        let (Some(node), Some(uid)) = (node_of(pod), pod.uid()) else {
            return;
        };
        let started = pod
            .status
            .as_ref()
            .and_then(|s| s.start_time.as_ref())
            .map_or_else(Timestamp::now, |t| t.0);
        let by_node = self.lock();
        let before = by_node.get(&node).and_then(|pods| pods.get(&uid));
        if let Some(h) = holder(pod, before, started) {
            listed.entry(node).or_default().insert(uid, h);
        }
    }

    /// The relist replaces what was kept: the nodes whose pods changed.
    fn replace(&self, listed: ByNode) -> Vec<String> {
        let mut by_node = self.lock();
        let changed: BTreeSet<String> = by_node
            .keys()
            .chain(listed.keys())
            .filter(|n| by_node.get(*n) != listed.get(*n))
            .cloned()
            .collect();
        *by_node = listed;
        changed.into_iter().collect()
    }

    /// The policy's GPUs that pods on `node` hold and the kubelet calls
    /// unhealthy: the device plugin's `quarantine.devicePluginResource`,
    /// and (with `dra`: the claims and the node's devices of
    /// `quarantine.draDriver`) DRA devices.
    pub fn on(
        &self,
        node: &str,
        quarantine: &Quarantine,
        dra: Option<(&Store<ResourceClaim>, &[DeviceView])>,
    ) -> Vec<UnhealthyDevice> {
        let by_node = self.lock();
        let Some(pods) = by_node.get(node) else {
            return Vec::new();
        };
        pods.values()
            .flat_map(|h| {
                h.devices.iter().filter_map(move |held| {
                    Some(UnhealthyDevice {
                        pod: format!("{}/{}", h.namespace, h.name),
                        device: place(held, &h.namespace, quarantine, dra)?,
                        message: held.message.clone(),
                        since: held.since,
                    })
                })
            })
            .collect()
    }
}

fn node_of(pod: &Pod) -> Option<String> {
    pod.spec.as_ref()?.node_name.clone()
}

/// What `pod` holds unhealthy, if anything; a device `before` knew keeps
/// its `since`, a new one is first seen at `seen`.
fn holder(pod: &Pod, before: Option<&Holder>, seen: Timestamp) -> Option<Holder> {
    let status = pod.status.as_ref()?;
    let mut devices = Vec::new();
    let containers = status
        .container_statuses
        .iter()
        .chain(status.init_container_statuses.iter())
        .flatten();
    for entry in containers.flat_map(|c| c.allocated_resources_status.iter().flatten()) {
        let resource = match entry.name.strip_prefix("claim:") {
            Some(claim) => Resource::Claim(claim_name(pod, claim.split('/').next()?)),
            None => Resource::Plugin(entry.name.clone()),
        };
        for r in entry.resources.iter().flatten() {
            if r.health.as_deref() != Some(UNHEALTHY) {
                continue;
            }
            let id = r.resource_id.clone();
            let since = before
                .and_then(|b| {
                    b.devices
                        .iter()
                        .find(|d| d.resource == resource && d.id == id)
                })
                .map_or(seen, |d| d.since);
            devices.push(Held {
                resource: resource.clone(),
                id,
                message: r.message.clone(),
                since,
            });
        }
    }
    (!devices.is_empty()).then(|| Holder {
        namespace: pod.namespace().unwrap_or_default(),
        name: pod.name_any(),
        devices,
    })
}

/// The ResourceClaim a pod's claim entry `entry` (`spec.resourceClaims`)
/// is: the one it names, or the one made for it from a template.
fn claim_name(pod: &Pod, entry: &str) -> Option<String> {
    let named = pod
        .spec
        .iter()
        .flat_map(|s| s.resource_claims.iter().flatten())
        .find(|c| c.name == entry)
        .and_then(|c| c.resource_claim_name.clone());
    named.or_else(|| {
        pod.status
            .iter()
            .flat_map(|s| s.resource_claim_statuses.iter().flatten())
            .find(|c| c.name == entry)
            .and_then(|c| c.resource_claim_name.clone())
    })
}

/// Which of the policy's GPUs `held` is, if it is one.
fn place(
    held: &Held,
    namespace: &str,
    quarantine: &Quarantine,
    dra: Option<(&Store<ResourceClaim>, &[DeviceView])>,
) -> Option<HeldDevice> {
    let claim = match &held.resource {
        Resource::Plugin(name) => {
            return (*name == quarantine.device_plugin_resource)
                .then(|| HeldDevice::Plugin(held.id.clone()));
        }
        Resource::Claim(claim) => claim,
    };
    let (claims, devices) = dra?;
    let ours = |id: &DeviceId| devices.iter().find(|d| d.is(id));
    let dra_device = |d: &DeviceView| HeldDevice::Dra {
        id: d.id(),
        uuid: d.uuid.clone(),
    };
    // A CDI device id (`vendor/class=name`) does not name the DRA device:
    // the claim's allocation does, if it holds one device only.
    if !held.id.contains('=') {
        let id = held.id.parse::<DeviceId>().ok()?;
        return ours(&id).map(dra_device);
    }
    let allocated = devices::allocated_to(claims, namespace, claim.as_deref()?);
    let mine: Vec<&DeviceView> = allocated.iter().filter_map(ours).collect();
    match (mine.as_slice(), allocated.len()) {
        ([], _) => None,
        ([d], 1) => Some(dra_device(d)),
        _ => Some(HeldDevice::Unplaced(held.id.clone())),
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::{
        api::core::v1::{
            ContainerStatus, PodResourceClaim, PodSpec, PodStatus, ResourceHealth, ResourceStatus,
        },
        apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
    };

    use super::*;

    fn ts(s: &str) -> Timestamp {
        s.parse().expect("timestamp")
    }

    /// Pod `name` on `node-a` whose one container the kubelet says holds
    /// `resources`: (resource name, id, health).
    fn pod(name: &str, resources: &[(&str, &str, &str)]) -> Pod {
        let mut by_name: BTreeMap<&str, Vec<ResourceHealth>> = BTreeMap::new();
        for (resource, id, health) in resources {
            by_name.entry(resource).or_default().push(ResourceHealth {
                resource_id: (*id).into(),
                health: Some((*health).into()),
                message: Some("Xid 79".into()),
            });
        }
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("serving".into()),
                uid: Some(format!("uid-{name}")),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some("node-a".into()),
                resource_claims: Some(vec![PodResourceClaim {
                    name: "gpu".into(),
                    resource_claim_name: Some(format!("{name}-gpu")),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
            status: Some(PodStatus {
                start_time: Some(Time(ts("2026-05-29T08:00:00Z"))),
                container_statuses: Some(vec![ContainerStatus {
                    name: "server".into(),
                    allocated_resources_status: Some(
                        by_name
                            .into_iter()
                            .map(|(name, resources)| ResourceStatus {
                                name: name.into(),
                                resources: Some(resources),
                            })
                            .collect(),
                    ),
                    ..Default::default()
                }]),
                ..Default::default()
            }),
        }
    }

    fn plugin_quarantine() -> Quarantine {
        Quarantine {
            device_plugin_resource: "nvidia.com/gpu".into(),
            ..Default::default()
        }
    }

    #[test]
    fn only_pods_holding_an_unhealthy_device_are_kept_and_each_keeps_when_it_turned() {
        let health = PodHealth::default();
        let well = pod("well", &[("nvidia.com/gpu", "GPU-1", "Healthy")]);
        assert_eq!(health.apply(&well, ts("2026-05-29T08:10:00Z")), None);
        assert!(health.lock().is_empty(), "a healthy pod costs nothing");

        let sick = pod(
            "sick",
            &[
                ("nvidia.com/gpu", "GPU-3", "Unhealthy"),
                ("nvidia.com/gpu", "GPU-4", "Unknown"),
                ("example.com/nic", "nic-0", "Unhealthy"),
            ],
        );
        assert_eq!(
            health.apply(&sick, ts("2026-05-29T08:10:00Z")).as_deref(),
            Some("node-a")
        );
        let seen = health.on("node-a", &plugin_quarantine(), None);
        assert_eq!(
            seen,
            [UnhealthyDevice {
                pod: "serving/sick".into(),
                device: HeldDevice::Plugin("GPU-3".into()),
                message: Some("Xid 79".into()),
                since: ts("2026-05-29T08:10:00Z"),
            }],
            "the policy's resource only, Unhealthy only"
        );
        // Seen again later, unchanged: it keeps when it turned.
        assert_eq!(health.apply(&sick, ts("2026-05-29T08:20:00Z")), None);
        // A relist keeps it too; a device turned while no one watched
        // counts from the pod's start.
        let mut listed = ByNode::new();
        health.relisted(&mut listed, &sick);
        let other = pod("other", &[("nvidia.com/gpu", "GPU-5", "Unhealthy")]);
        health.relisted(&mut listed, &other);
        assert_eq!(health.replace(listed), ["node-a"]);
        let since: Vec<(String, Timestamp)> = health
            .on("node-a", &plugin_quarantine(), None)
            .into_iter()
            .map(|u| (u.pod, u.since))
            .collect();
        assert_eq!(
            since,
            [
                ("serving/other".to_owned(), ts("2026-05-29T08:00:00Z")),
                ("serving/sick".to_owned(), ts("2026-05-29T08:10:00Z")),
            ]
        );
        // Gone, or well again: forgotten.
        assert_eq!(health.remove(&sick).as_deref(), Some("node-a"));
        let mended = pod("other", &[("nvidia.com/gpu", "GPU-5", "Healthy")]);
        assert_eq!(
            health.apply(&mended, ts("2026-05-29T08:30:00Z")).as_deref(),
            Some("node-a")
        );
        assert!(health.lock().is_empty());
    }

    #[test]
    fn a_claims_device_is_placed_by_its_dra_id_or_by_the_claims_allocation() {
        let devices: Vec<DeviceView> = (0..2)
            .map(|i| DeviceView {
                driver: "gpu.example.com".into(),
                pool: "node-a".into(),
                name: format!("gpu-{i}"),
                uuid: Some(format!("GPU-{i}")),
                taints: Vec::new(),
            })
            .collect();
        let (claims, mut writer) = kube::runtime::reflector::store::<ResourceClaim>();
        // Claims allocated devices of node-a's pool, by device name.
        let claim = |name: &str, allocated: &[&str]| {
            serde_json::from_value::<ResourceClaim>(serde_json::json!({
                "metadata": {"name": name, "namespace": "serving"},
                "spec": {},
                "status": {"allocation": {"devices": {"results": allocated.iter().map(|d| {
                    serde_json::json!({"driver": "gpu.example.com", "pool": "node-a", "device": d, "request": "gpu"})
                }).collect::<Vec<_>>()}}}
            }))
            .expect("claim")
        };
        writer.apply_watcher_event(&Event::Apply(claim("one-gpu", &["gpu-1"])));
        writer.apply_watcher_event(&Event::Apply(claim("two-gpu", &["gpu-0", "gpu-1"])));
        let quarantine = Quarantine {
            dra_driver: "gpu.example.com".into(),
            ..Default::default()
        };
        let health = PodHealth::default();
        let now = ts("2026-05-29T08:10:00Z");
        for (pod_name, id) in [
            ("by-id", "gpu.example.com/node-a/gpu-0"),
            ("one", "k8s.gpu.example.com/device=a"),
            ("two", "k8s.gpu.example.com/device=b"),
            ("nic", "nic.example.com/node-a/nic-0"),
        ] {
            let mut p = pod(pod_name, &[("claim:gpu", id, "Unhealthy")]);
            let claim = match pod_name {
                "one" => "one-gpu",
                "two" => "two-gpu",
                _ => "none",
            };
            p.spec
                .as_mut()
                .expect("spec")
                .resource_claims
                .as_mut()
                .expect("claims")[0]
                .resource_claim_name = Some(claim.into());
            health.apply(&p, now);
        }
        let placed: BTreeMap<String, HeldDevice> = health
            .on("node-a", &quarantine, Some((&claims, &devices)))
            .into_iter()
            .map(|u| (u.pod, u.device))
            .collect();
        let dra = |i: u32| HeldDevice::Dra {
            id: DeviceId::new("gpu.example.com", "node-a", format!("gpu-{i}")),
            uuid: Some(format!("GPU-{i}")),
        };
        assert_eq!(
            placed,
            BTreeMap::from([
                ("serving/by-id".to_owned(), dra(0)),
                ("serving/one".to_owned(), dra(1)),
                (
                    "serving/two".to_owned(),
                    HeldDevice::Unplaced("k8s.gpu.example.com/device=b".into())
                ),
            ]),
            "another driver's device is none of ours"
        );
        // Without DRA, a claim's device is not read.
        assert!(health.on("node-a", &quarantine, None).is_empty());
    }
}
