//! Why a node is where it is: `status.reason`.

use super::words;

words! {
    /// Why the node is in its phase, in one CamelCase word.
    pub enum Reason {
        // Suspect: a signal, but gpuhealth does not act (yet).
        /// A signal holds, but not yet for its `for` duration.
        SignalPending,
        /// The policy is `Paused`.
        Paused,
        /// The policy is `DryRun`: `status.plan` says what it would do.
        DryRun,
        /// Another tool (per `otherActors`) is disrupting the node.
        DisruptedByOther,
        /// `maxConcurrent` nodes are already being remediated.
        WaitingForBudget,
        /// More of the policy's nodes are unhealthy than `maxUnhealthy` allows.
        CircuitOpen,
        /// The policy left `Enforce` mid-remediation: held where it was.
        Held,
        /// The install's admission protection is not in force (a policy or
        /// binding missing, or a forbidden write let through): gpuhealth
        /// acts on nothing until it is.
        Unprotected,
        /// The policy is past a bound the cluster's administrator set
        /// (the operator's guardrails): it enforces nothing until it is
        /// within them, and its `Ready` condition names the bound.
        PastGuardrail,

        // Quarantined for a signal: the strongest one names it.
        /// An Xid asks for an action.
        Xid,
        /// A node condition in `detection.nodeConditions` holds.
        NodeCondition,
        /// A GPU reports `ResetRequired`.
        GpuResetRequired,
        /// A GPU reports `RebootRequired`.
        GpuRebootRequired,
        /// A GPU reports `Lost`.
        GpuLost,
        /// A GPU reports `Degraded`, which the policy counts as unhealthy.
        GpuDegraded,
        /// A GPU's NVML recovery action asks for an action.
        RecoveryAction,
        /// A GPU whose repair waits for its next reset (a pending row
        /// remap) is repaired now, while a gang whose members it serves is
        /// down anyway for another node's incident.
        RepairedWithGang,
        /// Application Xids repeat on a GPU more than the policy allows.
        RepeatedAppXids,
        /// A DRA driver tainted a GPU's device with a key in
        /// `detection.deviceTaints`.
        DeviceTainted,
        /// The kubelet reports a GPU a pod holds `Unhealthy` in the pod's
        /// status.
        DeviceUnhealthy,
        /// A signal with no reason of its own.
        Unhealthy,

        // Quarantined, held back.
        /// A provider's maintenance is due: the node is drained ahead of it.
        MaintenanceScheduled,
        /// The next step disrupts healthy GPUs, which waits for a maintenance window.
        OutsideMaintenanceWindow,
        /// The last remediation ended within `remediationLimits.cooldown`.
        Cooldown,

        // Draining.
        /// Pods are leaving.
        Draining,
        /// A pod that may not be evicted now holds the drain.
        WaitingForPod,
        /// A PodDisruptionBudget allows no disruption of a pod to evict.
        WaitingForDisruptionBudget,
        /// Every pod is leaving ahead of a scheduled maintenance.
        DrainingForMaintenance,

        /// Drained; the provider's maintenance has not happened yet.
        AwaitingMaintenance,
        /// A reset or reboot has been requested from the node's agent.
        ActionRequested,
        /// A pod came to hold a GPU of the action after its drain (a claim
        /// allocated before the fence was up): it is drained, and the
        /// request is not written again while it is there.
        HolderArrived,

        // Verifying.
        /// The action is done; waiting for every signal to stay clear.
        Verifying,
        /// Signals are clear; waiting for the node's executor to finish
        /// DCGM's diagnostic on the repaired GPUs.
        Diagnosing,
        /// Signals are clear; waiting for the validation pod to succeed.
        Validating,

        // Failed: the node stays cordoned for a person.
        /// The node or GPU was remediated as often as `remediationLimits` allows.
        RepeatedFailures,
        /// Pods were still on the node at `drain.timeout`.
        DrainTimeout,
        /// Every rung of the escalation ladder failed.
        EscalationExhausted,
        /// DCGM's diagnostic could not run (no dcgmi, no host engine, a
        /// DCGM error): no rung would make it run, so the GPU is held
        /// unproven for a person.
        DiagnosticsUnavailable,
        /// Handed off for replacement (`ReplaceNode`).
        ReplacementRequested,
        /// An administrator cleared a request or the cordon record by hand.
        BreakGlass,
        /// The Node was deleted mid-incident: whatever was in flight is
        /// abandoned with it.
        NodeDeleted,
    }
}

impl Reason {
    /// Whether a node held for this reason counts as unhealthy for the
    /// circuit breaker: a signal not yet firm says nothing about the fleet.
    /// A deleted node is no longer one of the fleet's.
    pub fn counts_as_unhealthy(self) -> bool {
        !matches!(
            self,
            Reason::SignalPending | Reason::NodeDeleted | Reason::RepairedWithGang
        )
    }
}
