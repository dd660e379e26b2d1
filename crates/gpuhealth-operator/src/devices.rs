//! Dynamic Resource Allocation, as the engine reads it: the node's GPUs as
//! a DRA driver publishes them in ResourceSlices, gpuhealth's
//! `DeviceTaintRule`s over them (crate::fences), and which GPUs a pod's
//! claims hold.
//!
//! `DeviceTaintRule` is served in `resource.k8s.io/v1` from Kubernetes 1.37
//! and in `v1beta2` on 1.36 with its feature gate on: the operator looks
//! once at start which the cluster serves, uses the newest, and fences per
//! GPU only if it serves one.

use std::{
    collections::{BTreeMap, BTreeSet},
    hash::{DefaultHasher, Hash, Hasher},
};

use futures::{StreamExt, channel::mpsc::UnboundedSender};
use gpuhealth_api::vocabulary::DeviceId;
use gpuhealth_engine::fence::{DeviceTaintView, DeviceView};
use k8s_openapi::api::{
    core::v1::{Node, Pod},
    resource::v1::{Device, ResourceClaim, ResourceSlice},
};
use kube::{
    Api, Client, ResourceExt,
    runtime::{
        WatchStreamExt,
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};
use tracing::info;

use crate::{discovery, fences};

/// What the operator keeps of the cluster's DRA objects, where it serves
/// them.
pub struct Dra {
    /// Every ResourceSlice, slimmed to its devices' names, UUIDs and taints.
    pub slices: Store<ResourceSlice>,
    /// Every ResourceClaim, slimmed to the devices it was allocated: which
    /// pod holds which device, read with no request of its own.
    pub claims: Store<ResourceClaim>,
    /// gpuhealth's own `DeviceTaintRule`s; None where none are served.
    pub rules: Option<fences::Rules>,
}

impl Dra {
    /// Resolves once every store has its first list: a step reading an
    /// empty one would take a fenced GPU's rule for gone (one node more
    /// than `maxConcurrent`, a replica just taken over, in the chaos runs)
    /// and a held GPU for free.
    pub async fn ready(&self) -> Result<(), reflector::store::WriterDropped> {
        self.slices.wait_until_ready().await?;
        self.claims.wait_until_ready().await?;
        if let Some(rules) = &self.rules {
            rules.store.wait_until_ready().await?;
        }
        Ok(())
    }
}

/// Starts the watches of what the cluster serves of DRA (none where it
/// serves no ResourceSlice); a change that a node's step reads (a device's
/// taints, a rule of ours) is sent as that node.
pub async fn watch(client: &Client, changed: UnboundedSender<ObjectRef<Node>>) -> Option<Dra> {
    if !discovery::served(client, "resource.k8s.io/v1", "resourceslices").await {
        info!("the cluster serves no resource.k8s.io/v1 ResourceSlices: no DRA device is read");
        return None;
    }
    let (slices, slice_writer) = reflector::store::<ResourceSlice>();
    let wake = changed.clone();
    tokio::spawn(
        watcher(
            Api::<ResourceSlice>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .modify(slim)
        .reflect(slice_writer)
        .applied_objects()
        .predicate_filter(devices_hash, Default::default())
        .for_each(move |slice| {
            if let Some(node) = slice.ok().and_then(|s| s.spec.node_name) {
                let _ = wake.unbounded_send(ObjectRef::new(&node));
            }
            futures::future::ready(())
        }),
    );
    let rules = fences::watch(client, changed).await;
    let (claims, claim_writer) = reflector::store::<ResourceClaim>();
    tokio::spawn(
        watcher(
            Api::<ResourceClaim>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .modify(slim_claim)
        .reflect(claim_writer)
        .for_each(|_| futures::future::ready(())),
    );
    Some(Dra {
        slices,
        claims,
        rules,
    })
}

/// Keeps of a slice its node, driver and pool, and of each device its
/// name, UUID and taints: a driver publishes kilobytes of attributes and
/// capacities per node that no step reads.
fn slim(slice: &mut ResourceSlice) {
    slice.metadata.managed_fields = None;
    slice.metadata.annotations = None;
    for d in slice.spec.devices.iter_mut().flatten() {
        let uuid = d.attributes.as_mut().and_then(|a| a.remove("uuid"));
        *d = Device {
            name: std::mem::take(&mut d.name),
            attributes: uuid.map(|u| [("uuid".to_owned(), u)].into()),
            taints: d.taints.take(),
            ..Device::default()
        };
    }
    slice.spec.shared_counters = None;
}

/// Keeps of a claim its name, namespace and the devices it was allocated.
fn slim_claim(claim: &mut ResourceClaim) {
    claim.metadata.managed_fields = None;
    claim.metadata.annotations = None;
    claim.spec = Default::default();
    if let Some(status) = claim.status.as_mut() {
        // Kept: whom a claim is reserved for names a holder before the
        // scheduler has bound it to the node.
        status.devices = None;
        if let Some(devices) = status.allocation.as_mut().and_then(|a| {
            a.node_selector = None;
            a.devices.as_mut()
        }) {
            devices.config = None;
        }
    }
}

/// What a node's step reads of a slimmed slice: its devices, their UUIDs
/// and taints.
fn devices_hash(slice: &ResourceSlice) -> Option<u64> {
    let mut hasher = DefaultHasher::new();
    serde_json::to_vec(&slice.spec.devices)
        .ok()?
        .hash(&mut hasher);
    Some(hasher.finish())
}

/// The devices `driver` publishes for `node`, from the watch.
pub fn devices_of(store: &Store<ResourceSlice>, node: &str, driver: &str) -> Vec<DeviceView> {
    store
        .state()
        .iter()
        .filter(|s| s.spec.driver == driver && s.spec.node_name.as_deref() == Some(node))
        .flat_map(|s| device_views(s))
        .collect()
}

fn device_views(slice: &ResourceSlice) -> Vec<DeviceView> {
    let spec = &slice.spec;
    spec.devices
        .iter()
        .flatten()
        .map(|d| DeviceView {
            driver: spec.driver.clone(),
            pool: spec.pool.name.clone(),
            name: d.name.clone(),
            uuid: d
                .attributes
                .as_ref()
                .and_then(|a| a.get("uuid"))
                .and_then(|a| a.string.clone()),
            taints: d
                .taints
                .iter()
                .flatten()
                .map(|t| DeviceTaintView {
                    key: t.key.clone(),
                    value: t.value.clone(),
                    effect: t.effect.clone(),
                    time_added: t.time_added.as_ref().map(|t| t.0),
                })
                .collect(),
        })
        .collect()
}

/// Per pod (`namespace/name`), the UUIDs of the GPUs its ResourceClaims
/// were allocated, among `devices`. A claim that cannot be read holds
/// nothing we know of; the agent's report may still name its GPU.
pub fn claimed_gpus(
    claims: &Store<ResourceClaim>,
    pods: &[Pod],
    devices: &[DeviceView],
) -> BTreeMap<String, Vec<String>> {
    let uuid_of: BTreeMap<DeviceId, &str> = devices
        .iter()
        .filter_map(|d| Some((d.id(), d.uuid.as_deref()?)))
        .collect();
    let mut held = BTreeMap::new();
    if uuid_of.is_empty() {
        return held;
    }
    for pod in pods {
        let namespace = pod.namespace().unwrap_or_default();
        let gpus: BTreeSet<String> = claim_names(pod)
            .into_iter()
            .filter_map(|name| claims.get(&ObjectRef::new(name).within(&namespace)))
            .flat_map(|c| allocated(&c).collect::<Vec<_>>())
            .filter_map(|id| uuid_of.get(&id).map(|u| (*u).to_owned()))
            .collect();
        if !gpus.is_empty() {
            held.insert(
                format!("{namespace}/{}", pod.name_any()),
                gpus.into_iter().collect(),
            );
        }
    }
    held
}

/// The pods (`namespace`, `name`) that claims allocated one of `devices`
/// are reserved for: each holds its device from the allocation on,
/// although the scheduler binds it to the node a moment later.
pub fn reserved_on(claims: &Store<ResourceClaim>, devices: &[DeviceView]) -> Vec<(String, String)> {
    reserved_among(claims.state().iter().map(AsRef::as_ref), devices)
}

/// [`reserved_on`], over `claims` as listed.
pub fn reserved_among<'a>(
    claims: impl IntoIterator<Item = &'a ResourceClaim>,
    devices: &[DeviceView],
) -> Vec<(String, String)> {
    let ids: BTreeSet<DeviceId> = devices.iter().map(DeviceView::id).collect();
    if ids.is_empty() {
        return Vec::new();
    }
    let mut pods = BTreeSet::new();
    for claim in claims {
        if !allocated(claim).any(|id| ids.contains(&id)) {
            continue;
        }
        let namespace = claim.namespace().unwrap_or_default();
        let reserved = claim
            .status
            .iter()
            .flat_map(|s| s.reserved_for.iter().flatten());
        for consumer in reserved.filter(|r| {
            r.resource == "pods" && r.api_group.as_deref().unwrap_or_default().is_empty()
        }) {
            pods.insert((namespace.clone(), consumer.name.clone()));
        }
    }
    pods.into_iter().collect()
}

/// The ResourceClaims a pod uses: those it names, and those made for it
/// from a template (its status names them).
fn claim_names(pod: &Pod) -> BTreeSet<&str> {
    let named = pod
        .spec
        .iter()
        .flat_map(|s| s.resource_claims.iter().flatten())
        .filter_map(|c| c.resource_claim_name.as_deref());
    let made = pod
        .status
        .iter()
        .flat_map(|s| s.resource_claim_statuses.iter().flatten())
        .filter_map(|c| c.resource_claim_name.as_deref());
    named.chain(made).collect()
}

/// The devices claim `namespace/name` was allocated, from the watch.
pub fn allocated_to(claims: &Store<ResourceClaim>, namespace: &str, name: &str) -> Vec<DeviceId> {
    claims
        .get(&ObjectRef::new(name).within(namespace))
        .map(|c| allocated(&c).collect())
        .unwrap_or_default()
}

/// The devices a claim was allocated.
fn allocated(claim: &ResourceClaim) -> impl Iterator<Item = DeviceId> + '_ {
    claim
        .status
        .iter()
        .filter_map(|s| s.allocation.as_ref())
        .filter_map(|a| a.devices.as_ref())
        .flat_map(|d| d.results.iter().flatten())
        .map(|r| DeviceId::new(&r.driver, &r.pool, &r.device))
}

#[cfg(test)]
mod tests {
    use futures::FutureExt;
    use gpuhealth_api::device_taint_rule::{DeviceTaintRule, RuleVersion};

    use super::*;
    use crate::fences::Rules;

    #[test]
    fn no_step_reads_the_devices_before_every_store_has_listed() {
        let (slices, mut slice_writer) = reflector::store::<ResourceSlice>();
        let (claims, mut claim_writer) = reflector::store::<ResourceClaim>();
        let mut rule_writer = reflector::store::Writer::<DeviceTaintRule>::new(RuleVersion::V1);
        let dra = Dra {
            slices,
            claims,
            rules: Some(Rules {
                store: rule_writer.as_reader(),
                version: RuleVersion::V1,
            }),
        };
        slice_writer.apply_watcher_event(&watcher::Event::InitDone);
        claim_writer.apply_watcher_event(&watcher::Event::InitDone);
        assert!(
            dra.ready().now_or_never().is_none(),
            "ready with the rules not yet listed"
        );
        rule_writer.apply_watcher_event(&watcher::Event::InitDone);
        assert!(matches!(dra.ready().now_or_never(), Some(Ok(()))));
    }

    #[test]
    fn a_pod_holds_the_gpus_its_claims_were_allocated() {
        let claim = |name: &str, device: &str| -> ResourceClaim {
            let mut c: ResourceClaim = serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": "ml"},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
                "status": {
                    "allocation": {"devices": {"results": [
                        {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-a", "device": device},
                    ]}},
                    "reservedFor": [{"resource": "pods", "name": "x", "uid": "u"}],
                },
            }))
            .expect("a claim");
            slim_claim(&mut c);
            c
        };
        let (claims, mut writer) = reflector::store::<ResourceClaim>();
        for c in [
            claim("direct", "gpu-7"),
            claim("made-from-template", "gpu-3"),
        ] {
            writer.apply_watcher_event(&watcher::Event::Apply(c));
        }
        let pods: Vec<Pod> = serde_json::from_value(serde_json::json!([
            {"metadata": {"name": "a", "namespace": "ml"},
             "spec": {"containers": [], "resourceClaims": [{"name": "gpu", "resourceClaimName": "direct"}]}},
            {"metadata": {"name": "b", "namespace": "ml"},
             "spec": {"containers": [], "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "t"}]},
             "status": {"resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": "made-from-template"}]}},
            {"metadata": {"name": "c", "namespace": "other"},
             "spec": {"containers": [], "resourceClaims": [{"name": "gpu", "resourceClaimName": "direct"}]}},
        ]))
        .expect("pods");
        let devices = eight_gpus("node-a");
        let held = claimed_gpus(&claims, &pods, &devices);
        assert_eq!(
            held,
            [
                ("ml/a".to_owned(), vec!["GPU-7".to_owned()]),
                ("ml/b".to_owned(), vec!["GPU-3".to_owned()]),
            ]
            .into(),
            "a claim of another namespace is not the pod's"
        );
    }

    /// GPUs 0-7 of `pool`, as the DRA driver publishes them.
    fn eight_gpus(pool: &str) -> Vec<DeviceView> {
        (0..8)
            .map(|i| DeviceView {
                driver: "gpu.nvidia.com".into(),
                pool: pool.into(),
                name: format!("gpu-{i}"),
                uuid: Some(format!("GPU-{i}")),
                taints: Vec::new(),
            })
            .collect()
    }

    #[test]
    fn a_claim_allocated_a_device_of_the_node_names_its_pod_before_it_is_bound() {
        let claim = |name: &str, pool: &str, reserved: serde_json::Value| -> ResourceClaim {
            let mut c: ResourceClaim = serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": "ml"},
                "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.nvidia.com"}}]}},
                "status": {
                    "allocation": {"devices": {"results": [
                        {"request": "gpu", "driver": "gpu.nvidia.com", "pool": pool, "device": "gpu-7"},
                    ]}},
                    "reservedFor": reserved,
                },
            }))
            .expect("a claim");
            slim_claim(&mut c);
            c
        };
        let (claims, mut writer) = reflector::store::<ResourceClaim>();
        for c in [
            claim(
                "newcomer-gpu",
                "node-a",
                serde_json::json!([{"resource": "pods", "name": "newcomer", "uid": "u"}]),
            ),
            claim(
                "elsewhere-gpu",
                "node-b",
                serde_json::json!([{"resource": "pods", "name": "elsewhere", "uid": "v"}]),
            ),
            claim("unreserved-gpu", "node-a", serde_json::json!([])),
        ] {
            writer.apply_watcher_event(&watcher::Event::Apply(c));
        }
        let devices = eight_gpus("node-a");
        assert_eq!(
            reserved_on(&claims, &devices),
            [("ml".to_owned(), "newcomer".to_owned())],
            "the slim claim keeps whom it is reserved for; another node's pool is not this node's"
        );
    }

    #[test]
    fn a_slim_slice_keeps_each_devices_name_uuid_and_taints() {
        let mut slice: ResourceSlice = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "node-a-gpu", "managedFields": [{"manager": "driver"}]},
            "spec": {
                "driver": "gpu.nvidia.com", "nodeName": "node-a",
                "pool": {"name": "node-a", "generation": 1, "resourceSliceCount": 1},
                "devices": [
                    {"name": "gpu-0", "attributes": {"uuid": {"string": "GPU-0"}, "productName": {"string": "H100"}},
                     "capacity": {"memory": {"value": "80Gi"}}},
                    {"name": "gpu-7", "attributes": {"uuid": {"string": "GPU-7"}},
                     "taints": [{"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoSchedule"}]},
                ],
            },
        }))
        .expect("a slice");
        slim(&mut slice);
        let device = &slice.spec.devices.as_ref().expect("devices")[0];
        assert_eq!(
            device.attributes.as_ref().map(|a| a.len()),
            Some(1),
            "only the uuid"
        );
        assert!(device.capacity.is_none());
        let (store, mut writer) = reflector::store::<ResourceSlice>();
        writer.apply_watcher_event(&watcher::Event::Apply(slice));
        let devices = devices_of(&store, "node-a", "gpu.nvidia.com");
        let seen: Vec<(&str, Option<&str>, usize)> = devices
            .iter()
            .map(|d| (d.name.as_str(), d.uuid.as_deref(), d.taints.len()))
            .collect();
        assert_eq!(
            seen,
            [("gpu-0", Some("GPU-0"), 0), ("gpu-7", Some("GPU-7"), 1)]
        );
        assert_eq!(
            devices[1].id(),
            DeviceId::new("gpu.nvidia.com", "node-a", "gpu-7")
        );
        assert!(devices_of(&store, "node-b", "gpu.nvidia.com").is_empty());
        assert!(devices_of(&store, "node-a", "other.example.com").is_empty());
    }
}
