//! What the operator must read for a node's step, beyond the node itself:
//! only what the step will look at, so that the operator's reads (and its
//! memory) follow the work in flight rather than the size of the fleet.

use gpuhealth_api::{
    GpuHealthPolicySpec,
    gang::GangMode,
    node_health::{GpuNodeHealthStatus, Phase},
    policy::Mode,
};

use super::{NodeView, validation_pod_name, workloads_to_watch};

/// What the operator knows of the pods holding a node's GPUs since its
/// last step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HoldersSince {
    /// The same pods as at the last step.
    Same,
    /// Other pods, or never looked at.
    Changed,
    /// Not listed at the last step (a quarantine decided on the report
    /// alone): they are due now, for their readiness gates.
    GatesPending,
}

/// What to read before the step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Needs {
    /// The pods on the node.
    pub pods: bool,
    /// The pods were due but wait one step: a healthy node newly reporting a
    /// bad GPU is quarantined on the report alone (one round trip fewer
    /// before the cordon), and its pods are listed at the next step, a
    /// second later at most, for their readiness gates, before any eviction.
    pub gates_later: bool,
    /// The PodDisruptionBudgets of those pods, for a `DryRun` plan and for
    /// a drain to name the budget that holds it (the Eviction API applies
    /// them).
    pub disruption_budgets: bool,
    /// The gangs of the node's pods, with their members cluster-wide: while
    /// a drain may evict them and the policy treats gangs as more than
    /// their members.
    pub gangs: bool,
    /// The gangs other nodes' incidents are taking down whole now: while
    /// the node's own drain may take a gang (one incident leads), or while
    /// it has a repair that waits for a reset, which such a window brings
    /// forward.
    pub gang_windows: bool,
    /// The workloads still watched after the last recovery.
    pub workloads: Vec<String>,
    /// The validation pod of the attempt being verified.
    pub validation_pod: Option<String>,
}

/// Whether a GPU's report has a repair that waits for its next reset.
fn repair_waits(node: &NodeView) -> bool {
    matches!(&node.report, Some(Ok(r)) if r.gpus.iter().any(|g| g.remapped_rows.as_ref().is_some_and(|rr| rr.pending && !rr.failure)))
}

pub fn needs(
    spec: &GpuHealthPolicySpec,
    state: &GpuNodeHealthStatus,
    node: &NodeView,
    holders: HoldersSince,
) -> Needs {
    let has_bad_gpu = matches!(&node.report, Some(Ok(r)) if r.bad_gpus().next().is_some());
    let gates_later = has_bad_gpu
        && state.phase == Phase::Healthy
        && spec.mode == Mode::Enforce
        && holders != HoldersSince::GatesPending;
    let pods = (state.phase != Phase::Healthy || has_bad_gpu || holders != HoldersSince::Same)
        && !gates_later;
    let validation_pod = match (&spec.verification.validation_pod, &state.action) {
        (Some(_), Some(action)) if state.phase == Phase::Verifying => {
            Some(validation_pod_name(&node.name, &action.id))
        }
        _ => None,
    };
    Needs {
        pods,
        gates_later,
        // For a DryRun plan, and for a drain to say which budget holds it.
        disruption_budgets: pods && (spec.mode == Mode::DryRun || state.phase == Phase::Draining),
        gangs: pods
            && spec.drain.gangs.mode != GangMode::Member
            && (spec.mode == Mode::DryRun
                || matches!(state.phase, Phase::Quarantined | Phase::Draining)),
        gang_windows: spec.drain.gangs.mode == GangMode::Whole
            && match state.phase {
                Phase::Quarantined | Phase::Draining => pods,
                Phase::Healthy | Phase::Suspect => repair_waits(node),
                _ => false,
            },
        workloads: workloads_to_watch(state),
        validation_pod,
    }
}
