//! What one step decides: the next status, the side effects that get
//! there, and what to say about it.

use std::{fmt, time::Duration};

use gpuhealth_api::{
    contract::{DiagnosticsLevel, RequestId},
    node_health::GpuNodeHealthStatus,
    vocabulary::{DeviceId, PodKey},
};
use k8s_openapi::jiff::Timestamp;

use crate::happening::Happening;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Set `spec.unschedulable` and `gpuhealth.io/cordoned-by` in one write.
    Cordon {
        incident: String,
    },
    /// Clear both, only if `gpuhealth.io/cordoned-by` still names `incident`.
    Uncordon {
        incident: String,
    },
    /// Remove a `gpuhealth.io/cordoned-by` naming `incident` from a node
    /// someone else uncordoned, only if the node is as decided on: left
    /// there, it would claim a person's next cordon as gpuhealth's.
    ForgetCordonRecord {
        incident: String,
    },
    /// Create the `DeviceTaintRule` `rule`, tainting `device` `NoSchedule`
    /// for `incident`; one that exists already is left as it is.
    TaintDevice {
        rule: String,
        device: DeviceId,
        incident: String,
    },
    /// Delete gpuhealth's `DeviceTaintRule` `rule`; one already gone is done.
    UntaintDevice {
        rule: String,
    },
    /// Evict through the Eviction API (PodDisruptionBudgets hold).
    Evict {
        pod: PodKey,
    },
    /// Tell a gang's member that its gang leaves at `at`: the
    /// `gpuhealth.io/evict-at` annotation and the
    /// `gpuhealth.io/disruption-pending` condition, with `why`.
    TellGangMember {
        pod: PodKey,
        at: Timestamp,
        why: String,
    },
    /// Delete a gang's member, with the `DisruptionTarget` condition
    /// written first and the policy's grace period: its gang leaves
    /// together, which the Eviction API (one pod at a time) cannot do.
    EvictGangMember {
        pod: PodKey,
        why: String,
    },
    /// Delete with no grace, bypassing budgets: only where the policy says so.
    ForceDelete {
        pod: PodKey,
    },
    /// Ask the agent to reset `gpus`. `requested_at` is the attempt's own
    /// time, so that a request re-issued after a crash is the same value,
    /// not a new one.
    RequestReset {
        id: RequestId,
        gpus: Vec<String>,
        requested_at: Timestamp,
    },
    RequestReboot {
        id: RequestId,
        requested_at: Timestamp,
    },
    /// Ask the agent to run DCGM's diagnostic at `level` on `gpus`,
    /// answering within `timeout` of `requested_at`.
    RequestDiagnostics {
        id: RequestId,
        gpus: Vec<String>,
        level: DiagnosticsLevel,
        timeout: gpuhealth_api::Duration,
        requested_at: Timestamp,
    },
    /// Create the validation pod `name` from the policy's template, pinned
    /// to the node; one that exists already is left as it is.
    CreateValidationPod {
        name: String,
    },
    DeleteValidationPod {
        name: String,
    },
    /// Set the pod's `gpuhealth.io/gpu-healthy` condition (its readiness gate).
    SetGpuHealthy {
        pod: PodKey,
        healthy: bool,
        message: String,
    },
    /// Remove `gpuhealth.io/break-glass` once its use is recorded.
    ClearBreakGlass,
    /// Label the node (for replacement); it stays cordoned.
    LabelNode {
        key: String,
        value: String,
    },
    /// Set the Node's `GpuHealthy` condition `Unknown` (reason `NoReport`,
    /// with `message`): it has no GPU report. Only on the node as decided
    /// on, so that a report written since is never contradicted.
    MarkGpuHealthUnknown {
        message: String,
    },
}

impl Action {
    /// Whether it keeps new work off a bad GPU: such actions go first.
    pub fn fences(&self) -> bool {
        self.kind().fences()
    }

    pub fn kind(&self) -> ActionKind {
        match self {
            Action::Cordon { .. } => ActionKind::Cordon,
            Action::Uncordon { .. } => ActionKind::Uncordon,
            Action::ForgetCordonRecord { .. } => ActionKind::ForgetCordonRecord,
            Action::Evict { .. } => ActionKind::Evict,
            Action::ForceDelete { .. } => ActionKind::ForceDelete,
            Action::TellGangMember { .. } => ActionKind::TellGangMember,
            Action::EvictGangMember { .. } => ActionKind::EvictGangMember,
            Action::RequestReset { .. } => ActionKind::RequestReset,
            Action::RequestReboot { .. } => ActionKind::RequestReboot,
            Action::RequestDiagnostics { .. } => ActionKind::RequestDiagnostics,
            Action::LabelNode { .. } => ActionKind::LabelNode,
            Action::MarkGpuHealthUnknown { .. } => ActionKind::MarkGpuHealthUnknown,
            Action::ClearBreakGlass => ActionKind::ClearBreakGlass,
            Action::CreateValidationPod { .. } => ActionKind::CreateValidationPod,
            Action::DeleteValidationPod { .. } => ActionKind::DeleteValidationPod,
            Action::SetGpuHealthy { .. } => ActionKind::SetGpuHealthy,
            Action::TaintDevice { .. } => ActionKind::TaintDevice,
            Action::UntaintDevice { .. } => ActionKind::UntaintDevice,
        }
    }
}

/// Which action, without what it carries: the `action` label of its
/// metric and the subject of its errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActionKind {
    Cordon,
    Uncordon,
    ForgetCordonRecord,
    Evict,
    ForceDelete,
    TellGangMember,
    EvictGangMember,
    RequestReset,
    RequestReboot,
    RequestDiagnostics,
    LabelNode,
    MarkGpuHealthUnknown,
    ClearBreakGlass,
    CreateValidationPod,
    DeleteValidationPod,
    SetGpuHealthy,
    TaintDevice,
    UntaintDevice,
}

impl ActionKind {
    /// Whether actions of this kind keep new work off a bad GPU.
    pub fn fences(self) -> bool {
        matches!(self, ActionKind::Cordon | ActionKind::TaintDevice)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ActionKind::Cordon => "cordon",
            ActionKind::Uncordon => "uncordon",
            ActionKind::ForgetCordonRecord => "forget_cordon_record",
            ActionKind::Evict => "evict",
            ActionKind::ForceDelete => "force_delete",
            ActionKind::TellGangMember => "tell_gang_member",
            ActionKind::EvictGangMember => "evict_gang_member",
            ActionKind::RequestReset => "request_reset",
            ActionKind::RequestReboot => "request_reboot",
            ActionKind::RequestDiagnostics => "request_diagnostics",
            ActionKind::LabelNode => "label_node",
            ActionKind::MarkGpuHealthUnknown => "mark_gpu_health_unknown",
            ActionKind::ClearBreakGlass => "clear_break_glass",
            ActionKind::CreateValidationPod => "create_validation_pod",
            ActionKind::DeleteValidationPod => "delete_validation_pod",
            ActionKind::SetGpuHealthy => "set_gpu_healthy",
            ActionKind::TaintDevice => "taint_device",
            ActionKind::UntaintDevice => "untaint_device",
        }
    }
}

impl fmt::Display for ActionKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub status: GpuNodeHealthStatus,
    pub actions: Vec<Action>,
    /// What to say about it, in Events and metrics.
    pub happenings: Vec<Happening>,
    /// When to look again if nothing changes before.
    pub requeue_after: Option<Duration>,
}
