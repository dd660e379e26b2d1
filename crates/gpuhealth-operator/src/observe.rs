//! Turning cluster objects into what the engine reads.

use std::{
    collections::BTreeMap,
    hash::{DefaultHasher, Hash, Hasher},
};

use gpuhealth_api::contract::{
    AnnotationValue, BREAK_GLASS_ANNOTATION, CORDONED_BY_ANNOTATION, CordonRecord,
    DIAGNOSTICS_REQUEST_ANNOTATION, DISRUPTION_TOLERANCE_ANNOTATION, DiagnosticsRequest,
    DisruptionTolerance, GPU_HEALTHY_READINESS_GATE, GPU_REPORT_ANNOTATION, GpuReport,
    MAINTENANCE_ANNOTATION, MaintenanceNotice, REBOOT_REQUEST_ANNOTATION,
    REQUEST_RESULT_ANNOTATION, RESET_REQUEST_ANNOTATION, RebootRequest, RequestId, RequestResult,
    ResetRequest,
};
use gpuhealth_api::{
    gang::{EVICT_AT_ANNOTATION, GangKey},
    policy::OtherActor,
    vocabulary::PodKey,
};
use gpuhealth_engine::{
    diagnosis::{ObservedCondition, UnhealthyDevice},
    drain::{BudgetView, GpuGate, PodView},
    fence::{DraView, ResourceCount},
    machine::NodeView,
    others::{NodeSignals, disruptions},
    workload::controller_of,
};
use k8s_openapi::{
    api::{
        core::v1::{Node, Pod},
        policy::v1::PodDisruptionBudget,
    },
    apimachinery::pkg::api::resource::Quantity,
    jiff::Timestamp,
};
use kube::{
    ResourceExt,
    core::{Selector, SelectorExt},
};

/// What the engine sees of a node besides the object itself.
#[derive(Default)]
pub struct Beside {
    /// The policy's device-plugin resource on the node.
    pub gpu_resource: Option<ResourceCount>,
    /// Its DRA devices and gpuhealth's rules over them.
    pub dra: Option<DraView>,
    /// Its GPUs the kubelet calls unhealthy in the pods holding them.
    pub unhealthy_devices: Vec<UnhealthyDevice>,
}

/// The node as the engine sees it, built once: with the other tools
/// `actors` names that are disrupting it (`named_by`: the locks that name
/// it, see `locks`), what is known of it `beside` the object, and
/// `first_seen`, when this process first saw its report as observed at
/// the time given, or with None, the node with no report
/// (`NodeMemory::report_first_seen`).
pub fn node_view(
    node: &Node,
    actors: &[OtherActor],
    named_by: &BTreeMap<String, String>,
    beside: Beside,
    first_seen: impl FnOnce(Option<Timestamp>) -> Timestamp,
) -> NodeView {
    let annotations = node.annotations();
    let parse_id =
        |key: &str, f: fn(&str) -> Option<RequestId>| annotations.get(key).and_then(|v| f(v));
    let conditions = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .map(|cs| {
            cs.iter()
                .map(|c| ObservedCondition {
                    type_: c.type_.clone(),
                    status: c.status.clone(),
                    last_transition: c
                        .last_transition_time
                        .as_ref()
                        .map_or(Timestamp::UNIX_EPOCH, |t| t.0),
                })
                .collect()
        })
        .unwrap_or_default();
    let report = annotations
        .get(GPU_REPORT_ANNOTATION)
        .map(|v| GpuReport::parse(v));
    let (report_refreshed_at, report_awaited_since) = match &report {
        Some(Ok(r)) => (Some(first_seen(Some(r.observed_at.0))), None),
        // None could have come before the Node was: awaited from the later.
        None => {
            let created = node.metadata.creation_timestamp.as_ref().map(|t| t.0);
            (
                None,
                Some(first_seen(None).max(created.unwrap_or_default())),
            )
        }
        Some(Err(_)) => (None, None),
    };
    NodeView {
        name: node.name_any(),
        unschedulable: node
            .spec
            .as_ref()
            .and_then(|s| s.unschedulable)
            .unwrap_or(false),
        cordoned_by: annotations
            .get(CORDONED_BY_ANNOTATION)
            .and_then(|v| CordonRecord::parse(v).ok())
            .map(|r| r.incident.to_string()),
        boot_id: node
            .status
            .as_ref()
            .and_then(|s| s.node_info.as_ref())
            .map(|i| i.boot_id.clone())
            .unwrap_or_default(),
        conditions,
        report,
        reset_request: parse_id(RESET_REQUEST_ANNOTATION, |v| {
            ResetRequest::parse(v).ok().map(|r| r.id)
        }),
        reboot_request: parse_id(REBOOT_REQUEST_ANNOTATION, |v| {
            RebootRequest::parse(v).ok().map(|r| r.id)
        }),
        diagnostics_request: parse_id(DIAGNOSTICS_REQUEST_ANNOTATION, |v| {
            DiagnosticsRequest::parse(v).ok().map(|r| r.id)
        }),
        result: annotations
            .get(REQUEST_RESULT_ANNOTATION)
            .map(|v| RequestResult::parse(v)),
        disrupted_by: disrupted_by(node, actors, named_by),
        maintenance: annotations
            .get(MAINTENANCE_ANNOTATION)
            .map(|v| MaintenanceNotice::parse(v)),
        report_refreshed_at,
        report_awaited_since,
        break_glass: annotations.get(BREAK_GLASS_ANNOTATION).cloned(),
        dra: beside.dra,
        gpu_resource: beside.gpu_resource,
        unhealthy_devices: beside.unhealthy_devices,
    }
}

/// A device plugin's `resource` on the node: capacity and allocatable.
pub fn resource_count(node: &Node, resource: &str) -> Option<ResourceCount> {
    let status = node.status.as_ref()?;
    let count = |m: &Option<BTreeMap<String, Quantity>>| -> Option<u32> {
        m.as_ref()?.get(resource)?.0.parse().ok()
    };
    Some(ResourceCount {
        capacity: count(&status.capacity)?,
        allocatable: count(&status.allocatable)?,
    })
}

/// Which of `actors` are disrupting `node` now.
pub fn disrupted_by(
    node: &Node,
    actors: &[OtherActor],
    named_by: &BTreeMap<String, String>,
) -> Vec<String> {
    let taints: BTreeMap<String, String> = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.as_ref())
        .map(|ts| {
            ts.iter()
                .map(|t| (t.key.clone(), t.value.clone().unwrap_or_default()))
                .collect()
        })
        .unwrap_or_default();
    disruptions(
        actors,
        NodeSignals {
            labels: node.labels(),
            annotations: node.annotations(),
            taints: &taints,
            named_by,
        },
    )
}

/// A pod as the drain planner sees it; `holders` maps `namespace/name` to the
/// GPU UUIDs the node's report says it holds.
/// A pod as the drain planner sees it; `gang_label` is the policy's own
/// label naming a pod's gang, if it has one.
pub fn pod_view(
    pod: &Pod,
    holders: &BTreeMap<String, Vec<String>>,
    gang_label: Option<&str>,
) -> PodView {
    let key = format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any());
    // NVIDIA's device plugin offers `nvidia.com/gpu`, shared GPUs and MIG
    // slices (`nvidia.com/mig-…`), all under `nvidia.com/`; a pod with
    // ResourceClaims may hold a GPU through DRA.
    let requests_gpu = pod.spec.as_ref().is_some_and(|s| {
        s.resource_claims.as_ref().is_some_and(|c| !c.is_empty())
            || s.containers.iter().any(|c| {
                c.resources.as_ref().is_some_and(|r| {
                    let has = |m: &Option<BTreeMap<String, _>>| {
                        m.as_ref()
                            .is_some_and(|m| m.keys().any(|k| k.starts_with("nvidia.com/")))
                    };
                    has(&r.limits) || has(&r.requests)
                })
            })
    });
    let phase = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .unwrap_or_default();
    PodView {
        namespace: pod.namespace().unwrap_or_default(),
        name: pod.name_any(),
        labels: pod.labels().clone(),
        daemon: pod.owner_references().iter().any(|o| o.kind == "DaemonSet"),
        mirror: pod
            .annotations()
            .contains_key("kubernetes.io/config.mirror"),
        terminating: pod.metadata.deletion_timestamp.is_some(),
        finished: matches!(phase, "Succeeded" | "Failed"),
        requests_gpu,
        gpus: holders.get(&key).cloned().unwrap_or_default(),
        tolerance: DisruptionTolerance::from_annotation(
            pod.annotations()
                .get(DISRUPTION_TOLERANCE_ANNOTATION)
                .map(String::as_str),
        ),
        workload: controller_of(pod),
        gpu_gate: gpu_gate(pod),
        gang: GangKey::of(pod, gang_label),
        // Unreadable: not told, and told again.
        evict_at: pod
            .annotations()
            .get(EVICT_AT_ANNOTATION)
            .and_then(|v| v.parse().ok()),
    }
}

/// The pod's `gpuhealth.io/gpu-healthy` readiness gate and its condition.
fn gpu_gate(pod: &Pod) -> GpuGate {
    let opted_in = pod
        .spec
        .as_ref()
        .and_then(|s| s.readiness_gates.as_ref())
        .is_some_and(|g| {
            g.iter()
                .any(|g| g.condition_type == GPU_HEALTHY_READINESS_GATE)
        });
    if !opted_in {
        return GpuGate::NotOptedIn;
    }
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == GPU_HEALTHY_READINESS_GATE))
        .map_or(GpuGate::Unset, |c| GpuGate::Is(c.status == "True"))
}

/// `namespace/name` → GPU UUIDs, from the node's report.
pub fn gpu_holders(view: &NodeView) -> BTreeMap<String, Vec<String>> {
    let mut holders: BTreeMap<String, Vec<String>> = BTreeMap::new();
    if let Some(Ok(report)) = &view.report {
        for gpu in &report.gpus {
            for p in &gpu.pods {
                holders
                    .entry(format!("{}/{}", p.namespace, p.name))
                    .or_default()
                    .push(gpu.uuid.clone());
            }
        }
    }
    holders
}

/// Which pods hold the node's GPUs, as one number: equal sets hash equal.
pub fn holders_hash(holders: &BTreeMap<String, Vec<String>>) -> u64 {
    let mut hasher = DefaultHasher::new();
    for pod in holders.keys() {
        pod.hash(&mut hasher);
    }
    hasher.finish()
}

/// Whether `node` is cordoned with gpuhealth's record of it: out of
/// service on gpuhealth's account whatever its status says.
pub fn carries_our_cordon(node: &Node) -> bool {
    node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true)
        && node.annotations().contains_key(CORDONED_BY_ANNOTATION)
}

/// The budgets among `pdbs` that cover any of `pods`, with the pods they cover.
/// A budget whose selector does not parse covers nothing.
pub fn budget_views(pdbs: &[PodDisruptionBudget], pods: &[PodView]) -> Vec<BudgetView> {
    pdbs.iter()
        .filter_map(|pdb| {
            let namespace = pdb.namespace().unwrap_or_default();
            let selector = pdb.spec.as_ref()?.selector.clone()?;
            let selector = Selector::try_from(selector).ok()?;
            let covered: Vec<PodKey> = pods
                .iter()
                .filter(|p| p.namespace == namespace && selector.matches(&p.labels))
                .map(PodView::key)
                .collect();
            (!covered.is_empty()).then(|| BudgetView {
                name: format!("{namespace}/{}", pdb.name_any()),
                allowed: pdb
                    .status
                    .as_ref()
                    .and_then(|s| s.disruptions_allowed)
                    .unwrap_or(0),
                pods: covered,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holding(pods: &[&str]) -> BTreeMap<String, Vec<String>> {
        pods.iter()
            .map(|p| ((*p).to_owned(), vec!["GPU-1".to_owned()]))
            .collect()
    }

    #[test]
    fn the_holders_hash_changes_with_the_set_of_pods_only() {
        let before = holders_hash(&holding(&["ml/a", "ml/b"]));
        assert_eq!(before, holders_hash(&holding(&["ml/b", "ml/a"])));
        assert_ne!(before, holders_hash(&holding(&["ml/a", "ml/b", "ml/c"])));
        assert_ne!(before, holders_hash(&holding(&["ml/a"])));
        assert_ne!(before, holders_hash(&holding(&["ml/ab"])));
    }
}
