//! Small enums shared by the policy, the node status and the node contract.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The health of one GPU, as a detector reports it.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
pub enum GpuHealth {
    /// Serving normally.
    Healthy,
    /// Working, with a warning worth recording (app-level Xids, pending row remap).
    Degraded,
    /// Needs a GPU reset before it can serve again.
    ResetRequired,
    /// Needs the node rebooted before it can serve again.
    RebootRequired,
    /// No longer answers (fallen off the bus, unknown error from NVML).
    Lost,
}

impl GpuHealth {
    /// Whether the GPU can run work as it is.
    pub fn is_serving(self) -> bool {
        matches!(self, GpuHealth::Healthy | GpuHealth::Degraded)
    }
}

/// A rung of the escalation ladder, weakest first.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
pub enum RecoveryAction {
    /// Reset the affected GPUs (`nvidia-smi --gpu-reset`), after their pods are drained.
    GpuReset,
    /// Reboot the node, after all its pods are drained.
    NodeReboot,
    /// Hand the node off for replacement: it stays cordoned and is labelled
    /// for the provisioner or a person; gpuhealth does nothing further.
    ReplaceNode,
}

/// What a signal (an Xid, a node condition) asks for.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
pub enum SignalAction {
    /// Record it; take no action on the node.
    Ignore,
    GpuReset,
    NodeReboot,
    ReplaceNode,
}

impl SignalAction {
    /// The ladder rung this signal starts from, if any.
    pub fn recovery_action(self) -> Option<RecoveryAction> {
        match self {
            SignalAction::Ignore => None,
            SignalAction::GpuReset => Some(RecoveryAction::GpuReset),
            SignalAction::NodeReboot => Some(RecoveryAction::NodeReboot),
            SignalAction::ReplaceNode => Some(RecoveryAction::ReplaceNode),
        }
    }
}
