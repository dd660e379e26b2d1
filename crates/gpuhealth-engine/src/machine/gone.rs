//! A node whose Node was deleted: what becomes of its record. Deleting a
//! Node takes its requests with it, so an incident it ends is never
//! silently done: it fails, a finding says so, and the record stays for a
//! person to read.

use gpuhealth_api::{
    node_health::{GpuNodeHealthStatus, Phase},
    policy::GpuHealthPolicySpec,
    vocabulary::{Attempt, AttemptOutcome, FindingKind, Reason},
};
use k8s_openapi::jiff::Timestamp;

use super::{Decision, Input, NodeView, RecordSeal, core::Stepper, is_disruptive};
use crate::{
    fence::{DraView, RuleView},
    guardrails::Guardrails,
};

/// What becomes of the record of a node whose Node is gone.
#[derive(Debug)]
pub enum Gone {
    /// Nothing of gpuhealth's was under way: the record goes with its node.
    Forget,
    /// The incident has already failed with its node, its fences down:
    /// the record stays until a person deletes it.
    Kept,
    /// Write this decision (the incident failed with its node, or the
    /// fences it left come down), then carry out its actions.
    Record(Box<Decision>),
}

/// The step for a node whose Node was deleted. `rules` are gpuhealth's
/// `DeviceTaintRule`s still up for it (None where the cluster serves
/// none): its devices went with it, and a Node registered later under the
/// same name must not find them fenced.
pub fn node_deleted(
    now: Timestamp,
    policy: &str,
    spec: &GpuHealthPolicySpec,
    rules: Option<Vec<RuleView>>,
    state: &GpuNodeHealthStatus,
) -> Gone {
    let deleted_before = state.phase == Phase::Failed && state.reason == Some(Reason::NodeDeleted);
    if !deleted_before && !is_disruptive(state.phase) {
        return Gone::Forget;
    }
    if deleted_before && state.quarantine.is_none() {
        return Gone::Kept;
    }
    let node = NodeView {
        dra: rules.map(|rules| DraView {
            can_taint: true,
            devices: Vec::new(),
            rules,
        }),
        ..NodeView::default()
    };
    let input = Input {
        now,
        policy,
        spec,
        node: &node,
        pods: &[],
        disruption_budgets: &[],
        gangs: &[],
        gang_windows: &[],
        validation: None,
        workloads: &[],
        budget: None,
        state,
        not_enforced: None,
        guardrails: &Guardrails::none(),
        // With the node gone nothing is asked of it: its record only says
        // which of gpuhealth's own fences to take down.
        seal: RecordSeal::Verified,
    };
    let mut s = Stepper::new(&input);
    if !deleted_before {
        s.node_deleted();
    }
    s.fences_down();
    Gone::Record(Box::new(s.decision()))
}

impl Stepper<'_> {
    /// The incident fails with its node: a request in flight is abandoned
    /// (the annotation went with the Node; an agent that outlived it has
    /// nothing to act on), and a finding says what was under way.
    fn node_deleted(&mut self) {
        let phase = self.status.phase;
        let in_flight = self
            .status
            .action
            .clone()
            .filter(|a| phase == Phase::Remediating && a.requested_at.is_some());
        let what = match &in_flight {
            Some(a) => format!(
                "{:?} attempt {} ({}) was in flight and is abandoned",
                a.type_, a.attempt, a.id
            ),
            None => format!("it was {phase:?}"),
        };
        let message = format!(
            "the Node was deleted mid-incident: {what}; this record stays Failed until you delete it (kubectl delete gpunodehealth NAME), or a Node of this name is registered again"
        );
        self.finding(FindingKind::NodeDeleted, None, message.clone());
        if let Some(a) = in_flight {
            self.record(
                Attempt::new(a.type_, a.attempt, AttemptOutcome::Cancelled)
                    .saying("the Node was deleted"),
            );
        }
        self.lift_quarantine();
        self.fail(Reason::NodeDeleted, message);
    }

    /// Takes down every rule of gpuhealth's still up for the node, and
    /// forgets the quarantine once none is.
    fn fences_down(&mut self) {
        let up = self.rules_up();
        for rule in &up {
            self.actions
                .push(super::Action::UntaintDevice { rule: rule.clone() });
        }
        if up.is_empty() {
            self.status.quarantine = None;
        }
    }
}
