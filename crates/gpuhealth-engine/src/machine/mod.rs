//! The remediation state machine: one pure step from what is stored and
//! what is observed to the next stored state and the actions that get there.
//!
//! `Healthy → Suspect → Quarantined → Draining → Remediating → Verifying →
//! Healthy`, with `Failed` when escalation is exhausted. The operator writes
//! the returned status *before* carrying out the actions, so every side
//! effect is preceded by its recorded intent, and every request carries the
//! id recorded with it: a restarted operator re-issues the same request,
//! which the agent recognises, and never a second one.
//!
//! Each phase has a handler in `phases/`; a handler says what comes next
//! (`Then`), and `step` runs them in a bounded loop. The handlers share
//! the verbs of `core` and the helpers beside it, never each other.

mod aftercare;
mod core;
mod decision;
mod drain_round;
mod gangs;
mod gone;
mod incident;
mod input;
mod ladder;
mod needs;
mod notice;
mod phases;
mod plan;
mod quarantine;
mod record_trust;
mod tenants;

use std::time::Duration;

use gpuhealth_api::{
    contract::MaintenanceNotice,
    node_health::{GpuNodeHealthStatus, Phase},
    policy::Mode,
    vocabulary::Reason,
};
use k8s_openapi::jiff::Timestamp;

use self::core::{Stage, Stepper, Then};
pub use self::{
    decision::{Action, ActionKind, Decision},
    gone::{Gone, node_deleted},
    input::{BudgetNeeded, Input, NodeView, NotEnforced, ValidationView, validation_pod_name},
    needs::{HoldersSince, Needs, needs},
    record_trust::{RecordSeal, in_flight, record_not_ours},
};
pub use crate::budget::is_disruptive;

/// How often to look again while waiting on something that sends no event
/// of its own (a timeout, a pod finishing on a schedule).
pub const POLL: Duration = Duration::from_secs(10);

/// How often to look at a draining node's pods: a pod leaving sends no event
/// to the node, and each second a drained node waits is a second of
/// capacity lost. One field-selected pod list per draining node.
pub const DRAIN_POLL: Duration = Duration::from_secs(2);

/// How long a `DeviceTaintRule` stands before the reset it fences is asked
/// for: a scheduler that had not yet seen the rule may allocate the device
/// for a moment after it is written, and that claim's pod must be seen,
/// and drained, first.
pub const FENCE_SETTLE: Duration = Duration::from_secs(2);

/// How long after a request the node may still not show it without the
/// request being written again: the watch lags the write.
pub const REISSUE_AFTER: Duration = Duration::from_secs(3);

/// How often to look at a running validation pod: its progress sends no
/// event to the node.
pub const VALIDATION_POLL: Duration = Duration::from_secs(2);

/// At most this many handlers run in one step. The longest path is
/// `Remediating → Verifying` (a result read, then recovered at once) or a
/// failed attempt's `Quarantined → Draining`: four leaves room, and a
/// bound keeps a handler that hands back by mistake from looping.
const HANDLERS_PER_STEP: usize = 4;

fn whole_second(t: Timestamp) -> Timestamp {
    Timestamp::from_second(t.as_second()).unwrap_or(t)
}

/// A maintenance notice in words.
fn maintenance_headline(n: &MaintenanceNotice) -> String {
    format!(
        "maintenance by {} due {}: {}",
        n.source, n.deadline.0, n.reason
    )
}

/// The workloads whose pods the last incident evicted and that are still
/// being watched after its recovery: the operator lists their pods.
pub fn workloads_to_watch(status: &GpuNodeHealthStatus) -> Vec<String> {
    status
        .history
        .first()
        .and_then(|i| i.workloads.as_ref())
        .filter(|w| w.deadline.is_some() && w.outcome.is_none())
        .map(|w| w.evicted.clone())
        .unwrap_or_default()
}

/// The node's next step; see [`Input::budget`] for when it needs a budget.
pub fn step(input: &Input<'_>) -> Result<Decision, BudgetNeeded> {
    let mut s = Stepper::new(input);
    s.observe();
    s.readiness_gates();
    if let Some(why) = record_not_ours(input) {
        s.hold_record_not_ours(why);
        return Ok(s.decision());
    }
    if let Some(reason) = &input.node.break_glass {
        // Nothing else this round: the next starts from what it left.
        s.break_glass(reason);
        return Ok(s.decision());
    }
    let mode = input.spec.mode;
    let at_rest = matches!(
        input.state.phase,
        Phase::Healthy | Phase::Suspect | Phase::Failed
    );
    if let (Some(held), false) = (input.not_enforced, at_rest) {
        // Whoever may patch Nodes could be driving this incident, or the
        // policy asks for more than the cluster allows: hold where we are,
        // as a paused policy does, until it is enforced again.
        s.status.reason = Some(held.reason);
        s.status.message = Some(format!(
            "remediation held in {:?}: {}",
            input.state.phase, held.why
        ));
        s.requeue = None;
        return Ok(s.decision());
    }
    if mode != Mode::Enforce && !at_rest {
        // Switched to DryRun or Paused mid-remediation: hold where we are and
        // touch nothing outside our own status until Enforce again.
        let message = format!(
            "policy mode is {mode:?}: remediation held in {:?}",
            input.state.phase
        );
        s.status.reason = Some(Reason::Held);
        s.status.message = Some(message);
        s.requeue = None;
        return Ok(s.decision());
    }
    let mut then = s.run(first_stage(input.state));
    for _ in 1..HANDLERS_PER_STEP {
        match then {
            Then::Run(next) => then = s.run(next),
            Then::Done => break,
        }
    }
    debug_assert_eq!(
        then,
        Then::Done,
        "a step handed on more than {HANDLERS_PER_STEP} times"
    );
    if s.budget_needed {
        return Err(BudgetNeeded);
    }
    s.keep_fences();
    s.forget_stale_cordon_record();
    Ok(s.decision())
}

/// The handler for the stored phase.
fn first_stage(state: &GpuNodeHealthStatus) -> Stage {
    match state.phase {
        Phase::Healthy | Phase::Suspect => Stage::HealthyOrSuspect,
        Phase::Quarantined | Phase::Draining if state.maintenance.is_some() => {
            Stage::MaintenanceDrain
        }
        // An attempt recorded but held back (by a maintenance window):
        // carry on with it rather than decide a new one.
        Phase::Quarantined
            if state
                .action
                .as_ref()
                .is_some_and(|a| a.requested_at.is_none()) =>
        {
            Stage::Draining
        }
        Phase::Quarantined => Stage::Quarantined,
        Phase::Draining => Stage::Draining,
        Phase::AwaitingMaintenance => Stage::AwaitingMaintenance,
        Phase::Remediating => Stage::Remediating,
        Phase::Verifying => Stage::Verifying,
        Phase::Failed => Stage::Failed,
    }
}
