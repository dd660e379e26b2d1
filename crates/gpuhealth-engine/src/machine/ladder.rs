//! The escalation ladder: which rung next, which attempt, and asking the
//! agent for it.

use std::time::Duration;

use gpuhealth_api::{
    RecoveryAction,
    contract::{Capabilities, REPLACE_LABEL, RequestId},
    node_health::{ActionStatus, Phase},
    policy::EscalationStep,
    vocabulary::{Attempt, AttemptOutcome, FindingKind, QuarantineWhy, Reason},
};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};

use crate::{diagnosis::after, happening::Happening};

use crate::machine::{
    Action, POLL,
    core::{Stage, Stepper, Then},
};

impl Stepper<'_> {
    /// What the node's agent says it can carry out, if it says.
    pub(super) fn capabilities(&self) -> Option<Capabilities> {
        match &self.input.node.report {
            Some(Ok(report)) => report.capabilities,
            _ => None,
        }
    }

    /// Why the node's agent cannot carry out `action`, if it cannot: that
    /// rung is passed over rather than requested and refused.
    pub(super) fn unavailable(&self, action: RecoveryAction) -> Option<String> {
        let can = self.capabilities()?;
        if can.can(action) {
            return None;
        }
        Some(match action {
            RecoveryAction::GpuReset => {
                "the node's agent cannot reset a GPU (its report says reset: false)".to_owned()
            }
            _ => "the node's agent does not reboot (its report says reboot: none)".to_owned(),
        })
    }

    /// Whether the open incident is one application Xids alone opened.
    fn opened_by_app_faults_alone(&self) -> bool {
        self.status
            .history
            .first()
            .filter(|i| self.status.incident.as_deref() == Some(i.id.as_str()))
            .is_some_and(|i| i.opened_by_app_faults_alone())
    }

    /// Records the next attempt (intent first) and moves to draining for it.
    pub(super) fn start_attempt(&mut self, rung: usize, attempt: u32) -> Then {
        let Some(step) = self.spec().escalation.get(rung).cloned() else {
            return self.exhausted();
        };
        if step.action == RecoveryAction::ReplaceNode && self.opened_by_app_faults_alone() {
            self.fail(
                Reason::EscalationExhausted,
                "every rung below replacement failed for an incident that application Xids alone opened: a tenant's code may be behind them, so the node is not handed over for replacement; it stays cordoned: look at what ran on the GPU, then uncordon".into(),
            );
            return Then::Done;
        }
        let incident = self.status.incident.clone().unwrap_or_default();
        let gpus = if step.action == RecoveryAction::GpuReset {
            self.gpus_to_reset()
        } else {
            Vec::new()
        };
        if step.action == RecoveryAction::GpuReset && gpus.is_empty() {
            // No report lists a GPU: a reset could name none, and the agent
            // refuses a request that names none.
            self.record(
                Attempt::new(RecoveryAction::GpuReset, attempt, AttemptOutcome::Skipped)
                    .saying("no GPU to name"),
            );
            return self.start_attempt(rung + 1, 1);
        }
        if let Some(why) = self.unavailable(step.action) {
            self.record(
                Attempt::new(step.action, attempt, AttemptOutcome::Skipped).saying(why.clone()),
            );
            self.finding(
                FindingKind::RungUnavailable,
                None,
                format!("{:?} passed over: {why}", step.action),
            );
            return self.start_attempt(rung + 1, 1);
        }
        if step.action >= RecoveryAction::NodeReboot {
            self.widen_to_node(
                QuarantineWhy::StepTakesTheNode,
                format!("{:?} takes the whole node down", step.action),
            );
        }
        self.status.action = Some(ActionStatus {
            id: RequestId::for_attempt(&incident, step.action, attempt),
            type_: step.action,
            attempt,
            gpus,
            started_at: Time(self.now()),
            requested_at: None,
            deadline: None,
        });
        self.status.clear_since = None;
        self.enter(
            Phase::Draining,
            Reason::Draining,
            format!("draining for {:?} attempt {attempt}", step.action),
        );
        Then::Run(Stage::Draining)
    }

    /// The GPUs a reset names: those the signals name now; else those the
    /// last attempt or the incident named (the fault may have cleared since,
    /// as a transient one does); else every GPU the report lists, since a
    /// signal that names no GPU concerns them all.
    pub(super) fn gpus_to_reset(&self) -> Vec<String> {
        let incident = self
            .status
            .history
            .first()
            .filter(|i| self.status.incident.as_deref() == Some(i.id.as_str()));
        let all_reported = || match &self.input.node.report {
            Some(Ok(report)) => report.gpus.iter().map(|g| g.uuid.clone()).collect(),
            _ => Vec::new(),
        };
        [
            self.diagnosis.gpus(),
            self.status
                .action
                .as_ref()
                .map(|a| a.gpus.clone())
                .unwrap_or_default(),
            incident.map(|i| i.gpus.clone()).unwrap_or_default(),
        ]
        .into_iter()
        .find(|gpus| !gpus.is_empty())
        .unwrap_or_else(all_reported)
    }

    pub(super) fn rung(&self, action: RecoveryAction) -> Option<&EscalationStep> {
        self.spec().escalation.iter().find(|r| r.action == action)
    }

    pub(super) fn attempt_failed(&mut self, why: String) -> Then {
        if let Some(action) = &self.status.action {
            let failed = Attempt::new(action.type_, action.attempt, AttemptOutcome::Failed);
            self.record(failed);
        }
        self.escalate(why)
    }

    /// The attempt in flight failed (and is recorded): the next one, up the
    /// ladder when this rung's attempts are spent.
    pub(super) fn escalate(&mut self, why: String) -> Then {
        let Some(action) = self.status.action.clone() else {
            return Then::Run(Stage::Quarantined);
        };
        self.tell(Happening::AttemptFailed { why });
        let ladder = &self.spec().escalation;
        let rung = ladder.iter().position(|r| r.action == action.type_);
        match rung {
            Some(i) if action.attempt < ladder[i].attempts => {
                self.start_attempt(i, action.attempt + 1)
            }
            Some(i) => self.start_attempt(i + 1, 1),
            // The policy changed under us: go to the next stronger rung.
            None => match ladder.iter().position(|r| r.action > action.type_) {
                Some(i) => self.start_attempt(i, 1),
                None => self.exhausted(),
            },
        }
    }

    pub(super) fn exhausted(&mut self) -> Then {
        let tried = self
            .status
            .history
            .first()
            .map(|i| {
                let tried: Vec<String> = i.attempts.iter().map(Attempt::to_string).collect();
                tried.join(", ")
            })
            .unwrap_or_default();
        self.fail(
            Reason::EscalationExhausted,
            format!(
                "every rung of the escalation ladder failed ({tried}); the node stays cordoned: inspect its GPUs (nvidia-smi, kernel log), repair or replace it, then uncordon"
            ),
        );
        Then::Done
    }

    /// Asks the node's agent to carry out `action`: the one place a request
    /// is written, when first made and each time it is re-issued. The same
    /// id and time each time, so the agent sees one request. The last rung
    /// (a replacement) is a label, not a request.
    pub(super) fn ask(&mut self, action: &ActionStatus, requested_at: Timestamp) {
        match action.type_ {
            RecoveryAction::GpuReset => self.actions.push(Action::RequestReset {
                id: action.id.clone(),
                gpus: action.gpus.clone(),
                requested_at,
            }),
            RecoveryAction::NodeReboot => self.actions.push(Action::RequestReboot {
                id: action.id.clone(),
                requested_at,
            }),
            RecoveryAction::ReplaceNode => {}
        }
    }

    pub(super) fn request(&mut self, mut action: ActionStatus) -> Then {
        // The agent may have said otherwise since the attempt was recorded:
        // a rung it cannot carry out is passed over, never requested.
        if let Some(why) = self.unavailable(action.type_) {
            self.record(
                Attempt::new(action.type_, action.attempt, AttemptOutcome::Skipped)
                    .saying(why.clone()),
            );
            self.finding(
                FindingKind::RungUnavailable,
                None,
                format!("{:?} passed over: {why}", action.type_),
            );
            let ladder = &self.spec().escalation;
            return match ladder.iter().position(|r| r.action > action.type_) {
                Some(i) => self.start_attempt(i, 1),
                None => self.exhausted(),
            };
        }
        let timeout = self
            .rung(action.type_)
            .map_or(Duration::ZERO, |r| r.effective_timeout().as_std());
        let now = self.now();
        action.requested_at = Some(Time(now));
        action.deadline = Some(Time(after(now, timeout)));
        let incident = self.status.incident.clone().unwrap_or_default();
        match action.type_ {
            RecoveryAction::GpuReset => self.ask(&action, now),
            RecoveryAction::NodeReboot => {
                self.status.boot_id_before_reboot = Some(self.input.node.boot_id.clone());
                self.ask(&action, now);
            }
            RecoveryAction::ReplaceNode => {
                self.actions.push(Action::LabelNode {
                    key: REPLACE_LABEL.into(),
                    value: incident,
                });
                self.record(Attempt::new(
                    RecoveryAction::ReplaceNode,
                    action.attempt,
                    AttemptOutcome::Requested,
                ));
                self.status.action = Some(action);
                self.fail(
                    Reason::ReplacementRequested,
                    "handed off for replacement: the node stays cordoned and is labelled gpuhealth.io/replace".into(),
                );
                return Then::Done;
            }
        }
        let message = requested(&action);
        self.status.action = Some(action);
        self.enter(Phase::Remediating, Reason::ActionRequested, message);
        self.wait(timeout.min(POLL));
        Then::Done
    }

    /// The attempt in flight succeeded: recorded, and the node verifies it.
    pub(super) fn attempt_succeeded(&mut self, action: &ActionStatus) -> Then {
        self.record(Attempt::new(
            action.type_,
            action.attempt,
            AttemptOutcome::Succeeded,
        ));
        self.status.clear_since = None;
        self.enter(Phase::Verifying, Reason::Verifying, verifying(action));
        Then::Run(Stage::Verifying)
    }
}

/// The status's words while `action` is in flight.
pub(super) fn requested(action: &ActionStatus) -> String {
    format!(
        "{:?} attempt {} requested ({})",
        action.type_, action.attempt, action.id
    )
}

/// The status's words while `action`'s GPUs are verified.
pub(super) fn verifying(action: &ActionStatus) -> String {
    format!(
        "{:?} done; waiting for every signal to stay clear",
        action.type_
    )
}
