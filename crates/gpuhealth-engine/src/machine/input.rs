//! What one step decides on: the node as observed, its pods and budgets,
//! the stored status.

use gpuhealth_api::{
    GpuHealthPolicySpec,
    contract::{ContractError, GpuReport, MaintenanceNotice, RequestId, RequestResult},
    node_health::GpuNodeHealthStatus,
    vocabulary::Reason,
};
use k8s_openapi::jiff::Timestamp;

use super::RecordSeal;
use crate::{
    budget::Budget,
    diagnosis::{ObservedCondition, UnhealthyDevice},
    drain::{BudgetView, PodView},
    fence::{DraView, ResourceCount},
    gangs::{GangView, GangWindow},
    guardrails::Guardrails,
    workload::WorkloadView,
};

/// The node as observed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeView {
    pub name: String,
    pub unschedulable: bool,
    /// The incident named by `gpuhealth.io/cordoned-by`, if gpuhealth cordoned it.
    pub cordoned_by: Option<String>,
    pub boot_id: String,
    pub conditions: Vec<ObservedCondition>,
    pub report: Option<Result<GpuReport, ContractError>>,
    /// The ids of the request annotations now on the node.
    pub reset_request: Option<RequestId>,
    pub reboot_request: Option<RequestId>,
    pub diagnostics_request: Option<RequestId>,
    pub result: Option<Result<RequestResult, ContractError>>,
    /// Other tools disrupting the node now, in words (see `others`).
    pub disrupted_by: Vec<String>,
    /// The `gpuhealth.io/maintenance` notice, if any.
    pub maintenance: Option<Result<MaintenanceNotice, ContractError>>,
    /// When the operator first saw the report as it is (a new `observedAt`),
    /// by the operator's clock: a report's age is judged on it, whatever the
    /// agent's clock says. None: the report's own time is taken.
    pub report_refreshed_at: Option<Timestamp>,
    /// With no report: since when one has been awaited, by the operator's
    /// clock: the later of the Node's creation and when the operator first
    /// saw it selected without one (a restarted operator awaits afresh).
    /// None: not said, and no report is then no finding.
    pub report_awaited_since: Option<Timestamp>,
    /// The reason an administrator gave in `gpuhealth.io/break-glass` when
    /// clearing a request or the cordon record by hand.
    pub break_glass: Option<String>,
    /// The node's DRA devices and gpuhealth's `DeviceTaintRule`s for it;
    /// None where the cluster serves no ResourceSlice.
    pub dra: Option<DraView>,
    /// The policy's device-plugin resource on the node, if it offers it.
    pub gpu_resource: Option<ResourceCount>,
    /// The policy's GPUs the kubelet reports unhealthy in the status of
    /// the pods on the node that hold them.
    pub unhealthy_devices: Vec<UnhealthyDevice>,
}

/// The validation pod of the attempt in flight, as observed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidationView {
    /// `status.phase`: `Pending`, `Running`, `Succeeded` or `Failed`.
    pub phase: String,
    /// Why it ended, from its status or its containers' termination.
    pub message: String,
}

/// The validation pod's name for an attempt on a node: one per attempt, so
/// a restarted operator finds the pod it created and a new attempt starts afresh.
pub fn validation_pod_name(node: &str, action_id: &RequestId) -> String {
    let mut name = format!("gpuhealth-validate-{node}-{action_id}");
    name.truncate(253);
    name.trim_end_matches(['-', '.']).to_owned()
}

/// A step about to start a remediation was given no budget: count it and
/// step again. Any other step decides the same with or without one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetNeeded;

/// Everything one step decides on.
pub struct Input<'a> {
    pub now: Timestamp,
    pub policy: &'a str,
    pub spec: &'a GpuHealthPolicySpec,
    pub node: &'a NodeView,
    /// The pods on the node; listed only while the node is under remediation.
    pub pods: &'a [PodView],
    /// The PodDisruptionBudgets covering those pods; read only for a
    /// `DryRun` plan (during a drain the Eviction API applies them).
    pub disruption_budgets: &'a [BudgetView],
    /// The gangs of the pods on the node that a drain would evict, with
    /// their members wherever they run (see [`super::Needs::gangs`]).
    pub gangs: &'a [GangView],
    /// Gangs other nodes' incidents are taking down whole now (see
    /// [`super::Needs::gang_windows`]).
    pub gang_windows: &'a [GangWindow],
    /// The validation pod of the attempt in flight, if the policy has one
    /// and it exists.
    pub validation: Option<&'a ValidationView>,
    /// The pods, wherever they run, of the workloads named by
    /// [`workloads_to_watch`]; empty otherwise.
    pub workloads: &'a [WorkloadView],
    /// The policy's budget for one more node, or None if not counted:
    /// counting walks the policy's whole fleet, and only a node about to
    /// start a remediation looks at it. Without it such a step stops with
    /// [`BudgetNeeded`]; the caller counts and steps again.
    pub budget: Option<Budget>,
    pub state: &'a GpuNodeHealthStatus,
    /// Why nothing of the policy is enforced now, whatever its mode: the
    /// install's admission protection is not in force, or the policy is past
    /// a guardrail. Then every step holds, as a paused policy's does.
    pub not_enforced: Option<NotEnforced<'a>>,
    /// Bounds the cluster's administrator set on every policy.
    pub guardrails: &'a Guardrails,
    /// What the operator found of `state`'s seal: a record in flight that
    /// is not the operator's is carried out in nothing.
    pub seal: RecordSeal,
}

/// Why a policy enforces nothing now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NotEnforced<'a> {
    /// `Unprotected` or `PastGuardrail`.
    pub reason: Reason,
    pub why: &'a str,
}
