//! What the operator keeps of each watched object: the fields its
//! decisions read. A Node as the API serves it carries `managedFields`, its
//! image list and hardware inventory, kilobytes the operator never reads;
//! kept for every node of a fleet, they were most of its memory (the
//! benchmark measured 41 KiB per node at 1,000 nodes).

use std::{
    collections::{BTreeMap, HashMap},
    hash::{DefaultHasher, Hash, Hasher},
    sync::Arc,
};

use gpuhealth_api::{
    GpuNodeHealth,
    contract::GPU_REPORT_ANNOTATION,
    node_health::{GpuNodeHealthStatus, GpuStatus},
};

use k8s_openapi::{
    api::core::v1::{Node, NodeCondition, NodeStatus, NodeSystemInfo},
    apimachinery::pkg::api::resource::Quantity,
};
use parking_lot::{Mutex, MutexGuard};

/// Written by `kubectl apply` (client-side): a copy of the whole object.
const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// Keeps metadata (less `managedFields`), the spec, each condition's type,
/// status and transition time, the boot id, and the extended resources'
/// capacity and allocatable (a device plugin's GPUs): all
/// `observe::node_view`, `observe::resource_count` and the selectors read.
pub fn node(node: &mut Node) {
    node.metadata.managed_fields = None;
    if let Some(annotations) = node.metadata.annotations.as_mut() {
        annotations.remove(LAST_APPLIED);
    }
    node.status = node.status.take().map(|status| NodeStatus {
        conditions: status.conditions.map(|conditions| {
            conditions
                .into_iter()
                .map(|c| NodeCondition {
                    type_: c.type_,
                    status: c.status,
                    last_transition_time: c.last_transition_time,
                    ..Default::default()
                })
                .collect()
        }),
        node_info: status.node_info.map(|info| NodeSystemInfo {
            boot_id: info.boot_id,
            ..Default::default()
        }),
        capacity: status.capacity.map(extended),
        allocatable: status.allocatable.map(extended),
        ..Default::default()
    });
}

/// Only the extended resources (`vendor/name`): cpu, memory and the rest
/// are never read.
fn extended(mut resources: BTreeMap<String, Quantity>) -> BTreeMap<String, Quantity> {
    resources.retain(|name, _| name.contains('/'));
    resources
}

/// The per-GPU tables left out of the cached health records, each kept
/// as a hash, by node. A record is read whole but for `managedFields` and
/// its `status.gpus`: the table is output, rebuilt from the node's report
/// by every decision, and it was most of a record (1.1 of its 1.6 KB, kept
/// for every node of the fleet). Its hash is what a decision needs to tell
/// whether the table it decided is the one the cluster holds.
#[derive(Clone, Default)]
pub struct GpuTables(Arc<Mutex<HashMap<String, u64>>>);

impl GpuTables {
    /// Slims each record the health records' watch brings.
    pub fn slimmer(&self) -> impl FnMut(&mut GpuNodeHealth) + Send + 'static {
        let tables = self.clone();
        move |health| {
            health.metadata.managed_fields = None;
            let table = health
                .status
                .as_mut()
                .map(|s| std::mem::take(&mut s.gpus))
                .unwrap_or_default();
            if let Some(name) = health.metadata.name.clone() {
                tables.lock().insert(name, table_hash(&table));
            }
        }
    }

    /// The hash of the table the cluster's record of `node` holds, as the
    /// watch last showed it; None if it never showed one.
    pub fn of(&self, node: &str) -> Option<u64> {
        self.lock().get(node).copied()
    }

    /// Forgets every node `still_there` does not name.
    pub fn forget_gone(&self, still_there: impl Fn(&str) -> bool) {
        self.lock().retain(|n, _| still_there(n));
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, u64>> {
        self.0.lock()
    }
}

/// A per-GPU table as a hash.
pub fn table_hash(table: &[GpuStatus]) -> u64 {
    let mut hasher = DefaultHasher::new();
    serde_json::to_vec(table)
        .unwrap_or_default()
        .hash(&mut hasher);
    hasher.finish()
}

/// A node's status as the cache shows it: without its per-GPU table, which
/// the table's hash stands for.
#[derive(Clone, Debug)]
pub struct CachedStatus {
    /// The status, its `gpus` empty.
    pub status: GpuNodeHealthStatus,
    /// The hash of the table the cluster holds; None if unknown.
    pub table: Option<u64>,
}

impl CachedStatus {
    /// Whether the cluster holds `status`, table and all.
    pub fn shows(&self, status: &GpuNodeHealthStatus) -> bool {
        self.table == Some(table_hash(&status.gpus))
            && self.status
                == GpuNodeHealthStatus {
                    gpus: Vec::new(),
                    ..status.clone()
                }
    }

    /// Whether the cluster's record holds a table the cache left out.
    pub fn has_table(&self) -> bool {
        self.table != Some(table_hash(&[]))
    }
}

/// A hash of what a reconcile reads of a slimmed node (everything but its
/// resourceVersion and the fields that never change): a change there is
/// worth a reconcile, a kubelet heartbeat (which moves only the stripped
/// fields and the resourceVersion) is not. Runs on every node event, so it
/// borrows rather than clones.
pub fn node_inputs(node: &Node) -> Option<u64> {
    let m = &node.metadata;
    // The agent refreshes its report every few minutes with nothing new but
    // the time: that alone is no change (a healthy node is looked at again
    // when its report would go stale).
    let annotations = m.annotations.as_ref().map(|a| {
        a.iter()
            .map(|(k, v)| match k.as_str() {
                GPU_REPORT_ANNOTATION => (k, without_observed_at(v)),
                _ => (k, std::borrow::Cow::Borrowed(v.as_str())),
            })
            .collect::<Vec<_>>()
    });
    let read = (
        &m.uid,
        &m.labels,
        &annotations,
        &m.owner_references,
        &m.deletion_timestamp,
        &node.spec,
        &node.status,
    );
    let mut hasher = DefaultHasher::new();
    serde_json::to_vec(&read).ok()?.hash(&mut hasher);
    Some(hasher.finish())
}

/// A report with its `"observedAt":"…"` member left out (as the agent
/// writes it; another writer's spacing just keeps it in).
fn without_observed_at(report: &str) -> std::borrow::Cow<'_, str> {
    const KEY: &str = "\"observedAt\":\"";
    let Some(start) = report.find(KEY) else {
        return report.into();
    };
    let value = start + KEY.len();
    match report[value..].find('"') {
        Some(end) => {
            let rest = &report[value + end + 1..];
            format!(
                "{}{}",
                &report[..start],
                rest.strip_prefix(',').unwrap_or(rest)
            )
            .into()
        }
        None => report.into(),
    }
}

#[cfg(test)]
mod tests {
    use kube::ResourceExt;

    use super::*;

    fn served(heartbeat: &str, resource_version: &str) -> Node {
        serde_json::from_value(serde_json::json!({
            "metadata": {
                "name": "gpu-1",
                "resourceVersion": resource_version,
                "labels": {"pool": "h100"},
                "annotations": {"gpuhealth.io/gpus": "{}", LAST_APPLIED: "{\"big\": true}"},
                "managedFields": [{"manager": "kubelet", "operation": "Update", "fieldsType": "FieldsV1", "fieldsV1": {"f:status": {}}}],
            },
            "spec": {"unschedulable": true, "taints": [{"key": "k", "effect": "NoSchedule"}]},
            "status": {
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                    "message": "kubelet is posting ready status",
                    "lastHeartbeatTime": heartbeat, "lastTransitionTime": "2026-11-01T00:00:00Z"}],
                "nodeInfo": {"bootID": "b-1", "machineID": "m", "systemUUID": "s", "kernelVersion": "6",
                    "osImage": "o", "containerRuntimeVersion": "c", "kubeletVersion": "v",
                    "kubeProxyVersion": "", "operatingSystem": "linux", "architecture": "amd64"},
                "images": [{"names": ["registry.example/vllm:1"], "sizeBytes": 1}],
                "capacity": {"nvidia.com/gpu": "8", "cpu": "96", "memory": "1Ti"},
                "allocatable": {"nvidia.com/gpu": "7", "cpu": "95"},
                "addresses": [{"type": "InternalIP", "address": "10.0.0.1"}],
            },
        }))
        .expect("a Node")
    }

    #[test]
    fn a_slim_node_keeps_what_decisions_read_and_drops_the_rest() {
        let mut n = served("2026-11-30T00:00:00Z", "1");
        node(&mut n);
        let view =
            crate::observe::node_view(&n, &[], &Default::default(), Default::default(), |t| {
                t.unwrap_or_default()
            });
        assert!(view.unschedulable);
        assert_eq!(view.boot_id, "b-1");
        assert_eq!(view.conditions.len(), 1);
        assert_eq!(view.conditions[0].status, "True");
        assert_eq!(
            view.conditions[0].last_transition.to_string(),
            "2026-11-01T00:00:00Z"
        );
        assert!(view.report.is_some());
        assert_eq!(n.labels()["pool"], "h100");
        let taints = n.spec.as_ref().and_then(|s| s.taints.as_ref());
        assert_eq!(taints.map(Vec::len), Some(1));
        assert_eq!(n.metadata.resource_version.as_deref(), Some("1"));
        assert!(n.metadata.managed_fields.is_none());
        assert!(!n.annotations().contains_key(LAST_APPLIED));
        let count = crate::observe::resource_count(&n, "nvidia.com/gpu").expect("the GPUs");
        assert_eq!((count.capacity, count.allocatable), (8, 7));
        let status = n.status.expect("a status");
        assert!(status.images.is_none() && status.addresses.is_none());
        let kept = |m: Option<BTreeMap<String, Quantity>>| {
            m.unwrap_or_default().into_keys().collect::<Vec<_>>()
        };
        assert_eq!(
            kept(status.capacity),
            ["nvidia.com/gpu"],
            "only extended resources"
        );
        assert_eq!(kept(status.allocatable), ["nvidia.com/gpu"]);
        assert_eq!(status.node_info.map(|i| i.machine_id), Some(String::new()));
    }

    #[test]
    fn a_heartbeat_is_not_a_change_but_a_cordon_is() {
        let slim = |heartbeat, rv| {
            let mut n = served(heartbeat, rv);
            node(&mut n);
            n
        };
        let before = slim("2026-11-30T00:00:00Z", "1");
        let heartbeat = slim("2026-11-30T00:10:00Z", "2");
        assert_eq!(node_inputs(&before), node_inputs(&heartbeat));
        let mut uncordoned = slim("2026-11-30T00:10:00Z", "3");
        uncordoned.spec = Some(Default::default());
        assert_ne!(node_inputs(&before), node_inputs(&uncordoned));
        let mut not_ready = slim("2026-11-30T00:10:00Z", "4");
        for c in not_ready
            .status
            .iter_mut()
            .flat_map(|s| s.conditions.iter_mut().flatten())
        {
            c.status = "False".into();
        }
        assert_ne!(node_inputs(&before), node_inputs(&not_ready));
        let mut sick = slim("2026-11-30T00:10:00Z", "5");
        sick.annotations_mut()
            .insert("gpuhealth.io/gpus".into(), "{\"version\":1}".into());
        assert_ne!(node_inputs(&before), node_inputs(&sick));
    }

    #[test]
    fn a_report_refreshed_with_nothing_new_is_not_a_change() {
        let with_report = |observed: &str, health: &str| {
            let mut n = served("2026-11-30T00:00:00Z", "1");
            node(&mut n);
            let report = format!(
                "{{\"version\":1,\"observedAt\":\"{observed}\",\"source\":\"gpuhealth-agent/nvml\",\"gpus\":[{{\"index\":0,\"uuid\":\"GPU-0a1b2c3d-0000-4000-8000-000000000000\",\"pciBusId\":\"00000000:01:00.0\",\"health\":\"{health}\"}}]}}"
            );
            n.annotations_mut()
                .insert(GPU_REPORT_ANNOTATION.into(), report);
            n
        };
        let first = with_report("2026-11-30T00:00:00Z", "Healthy");
        let refreshed = with_report("2026-11-30T00:05:00Z", "Healthy");
        let broken = with_report("2026-11-30T00:05:00Z", "ResetRequired");
        assert_eq!(node_inputs(&first), node_inputs(&refreshed));
        assert_ne!(node_inputs(&refreshed), node_inputs(&broken));
        assert_eq!(
            without_observed_at(
                "{\"version\":1,\"observedAt\":\"2026-11-30T00:00:00Z\",\"gpus\":[]}"
            ),
            "{\"version\":1,\"gpus\":[]}"
        );
    }

    #[test]
    fn a_cached_record_keeps_its_gpu_table_as_a_hash_that_tells_a_change() {
        let table = |health: &str| -> Vec<GpuStatus> {
            serde_json::from_value(serde_json::json!([{"index": 0,
                "uuid": "GPU-0a1b2c3d-0000-4000-8000-000000000000",
                "pciBusId": "00000000:01:00.0", "health": health}]))
            .expect("a table")
        };
        let status = GpuNodeHealthStatus {
            gpus: table("Healthy"),
            bad_gpus: 0,
            ..Default::default()
        };
        let mut record = GpuNodeHealth::new("gpu-1", Default::default());
        record.status = Some(status.clone());
        let tables = GpuTables::default();
        tables.slimmer()(&mut record);
        let kept = record.status.clone().expect("a status");
        assert!(kept.gpus.is_empty(), "the table is left out");
        let cached = CachedStatus {
            status: kept,
            table: tables.of("gpu-1"),
        };
        assert!(cached.has_table());
        assert!(cached.shows(&status));
        let changed = GpuNodeHealthStatus {
            gpus: table("ResetRequired"),
            ..status.clone()
        };
        assert!(!cached.shows(&changed), "a change in the table alone");
        let moved = GpuNodeHealthStatus {
            bad_gpus: 1,
            ..status.clone()
        };
        assert!(!cached.shows(&moved), "a change beside the table");
        let unknown = CachedStatus {
            table: None,
            ..cached
        };
        assert!(!unknown.shows(&status) && unknown.has_table());
        tables.forget_gone(|n| n != "gpu-1");
        assert_eq!(tables.of("gpu-1"), None);
    }
}
