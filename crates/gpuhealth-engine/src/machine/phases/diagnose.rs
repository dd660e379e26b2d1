//! `Verifying`, once signals have stayed clear: DCGM's diagnostic on the
//! repaired GPUs, run by the node's executor, where the policy asks for one.

use gpuhealth_api::{
    contract::{DiagnosticsLevel, DiagnosticsVerdict, RequestId, RequestResult},
    node_health::{ActionStatus, Phase},
    vocabulary::{Attempt, AttemptAction, AttemptOutcome, Reason},
};
use k8s_openapi::jiff::Timestamp;

use crate::diagnosis::after;

use crate::machine::{
    Action, VALIDATION_POLL,
    core::{Stepper, Then},
};

impl Stepper<'_> {
    /// The diagnostic of `action`'s GPUs, asked for once their signals have
    /// been clear since `since`: `Ok` with when it passed (or `since`, where
    /// the policy asks for none), or `Err` with what this step does instead.
    pub(in crate::machine) fn diagnose(
        &mut self,
        action: &ActionStatus,
        since: Timestamp,
    ) -> Result<Timestamp, Then> {
        let wanted = self.spec().verification.diagnostics.clone();
        if wanted.level == DiagnosticsLevel::None {
            return Ok(since);
        }
        let id = RequestId::for_diagnostics(&action.id);
        let answer = match &self.input.node.result {
            Some(Ok(r)) if r.id == id => Some(r.clone()),
            _ => None,
        };
        if let Some(answer) = &answer
            && self.diagnosed(action)
        {
            return Ok(answer.finished_at.0.max(since));
        }
        let ended = |outcome| Attempt::new(AttemptAction::Diagnostics, action.attempt, outcome);
        match answer {
            Some(answer) => self.diagnosed_as(action, answer, since),
            None if self.now() >= after(since, wanted.timeout.as_std()) => {
                self.record(ended(AttemptOutcome::TimedOut).saying(id.to_string()));
                Err(self.escalate(format!(
                    "the {} DCGM diagnostic ({id}) was not answered within {}",
                    wanted.level, wanted.timeout
                )))
            }
            None => {
                let gpus = self.diagnosed_gpus(action);
                if gpus.is_empty() {
                    self.record(ended(AttemptOutcome::Failed).saying("no GPU reported"));
                    return Err(self
                        .escalate("no GPU to diagnose: the node's report lists none".to_owned()));
                }
                if self.input.node.diagnostics_request.as_ref() != Some(&id) {
                    // The same value every time (its time is `since`): a
                    // second write while the watch lags changes nothing.
                    self.actions.push(Action::RequestDiagnostics {
                        id: id.clone(),
                        gpus: gpus.clone(),
                        level: wanted.level,
                        timeout: wanted.timeout,
                        requested_at: since,
                    });
                }
                self.enter(
                    Phase::Verifying,
                    Reason::Diagnosing,
                    format!(
                        "signals clear; waiting for the {} DCGM diagnostic of {} ({id})",
                        wanted.level,
                        gpus.join(", ")
                    ),
                );
                self.wait(VALIDATION_POLL);
                Err(Then::Done)
            }
        }
    }

    /// The GPUs the action repaired: those it names, or every GPU of the
    /// node (a reboot's).
    fn diagnosed_gpus(&self, action: &ActionStatus) -> Vec<String> {
        if !action.gpus.is_empty() {
            return action.gpus.clone();
        }
        match &self.input.node.report {
            Some(Ok(report)) => report.gpus.iter().map(|g| g.uuid.clone()).collect(),
            _ => Vec::new(),
        }
    }

    /// Whether this attempt's diagnostic is on the record as passed: a
    /// step after it (the validation pod's) records nothing twice.
    fn diagnosed(&self, action: &ActionStatus) -> bool {
        self.status
            .history
            .first()
            .and_then(|i| i.attempts.last())
            .is_some_and(|a| {
                a.action == AttemptAction::Diagnostics
                    && a.attempt == action.attempt
                    && a.outcome == AttemptOutcome::Succeeded
            })
    }

    /// The executor's answer, recorded with each test's verdict: a pass
    /// goes on, a diagnostic that could not run holds the node for a
    /// person, anything else is a failed attempt.
    fn diagnosed_as(
        &mut self,
        action: &ActionStatus,
        answer: RequestResult,
        since: Timestamp,
    ) -> Result<Timestamp, Then> {
        let verdict = answer.diagnostics.as_ref().map(|d| d.verdict);
        let outcome = match verdict {
            Some(v) if v.passed() => AttemptOutcome::Succeeded,
            Some(DiagnosticsVerdict::TimedOut) => AttemptOutcome::TimedOut,
            _ => AttemptOutcome::Failed,
        };
        let mut attempt = Attempt::new(AttemptAction::Diagnostics, action.attempt, outcome)
            .saying(answer.message.clone());
        attempt.diagnostics = answer.diagnostics.clone();
        self.record(attempt);
        if outcome == AttemptOutcome::Succeeded {
            return Ok(answer.finished_at.0.max(since));
        }
        if verdict == Some(DiagnosticsVerdict::Error) {
            // A missing dcgmi or host engine is the install's, not the
            // GPU's: a reboot would not make it run, only cost one.
            self.fail(
                Reason::DiagnosticsUnavailable,
                format!(
                    "DCGM's diagnostic ({}) could not run: {}; the GPU stays fenced, unproven: give the executor a dcgmi and host engine (--dcgmi, --dcgm-host) or set verification.diagnostics.level to None, then uncordon",
                    answer.id, answer.message
                ),
            );
            return Err(Then::Done);
        }
        let what = match verdict {
            Some(v) => v.to_string(),
            None => format!("{:?}", answer.outcome),
        };
        Err(self.escalate(format!(
            "DCGM diagnostic {}: {what}: {}",
            answer.id, answer.message
        )))
    }
}
