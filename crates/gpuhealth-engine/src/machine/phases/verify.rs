//! `Verifying`: every signal must stay clear (and the diagnostic pass and
//! the validation pod succeed) before the node is back in service.

use std::time::Duration;

use gpuhealth_api::{
    node_health::{ActionStatus, Phase},
    quarantine::{Fenced, GpuFence},
    vocabulary::{Attempt, AttemptAction, AttemptOutcome, IncidentOutcome, Reason},
};
use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::{self, Timestamp},
};

use crate::{diagnosis::after, fence::gpu_name};

use crate::machine::{
    Action, POLL, VALIDATION_POLL,
    core::{Stage, Stepper, Then},
    validation_pod_name,
};

impl Stepper<'_> {
    pub(in crate::machine) fn verifying(&mut self) -> Then {
        let Some(action) = self.status.action.clone() else {
            return Then::Run(Stage::Quarantined);
        };
        // Where the fence stands until the GPU is verified, a pod that
        // comes to hold it meanwhile leaves as the first holders did.
        if self.fenced_until_verified(&action) {
            self.drain_newcomers(&action);
        }
        let requested = action.requested_at.as_ref().map_or(self.now(), |t| t.0);
        // Only a report written after the action says anything about it:
        // after the request by the operator's clock, or after the answer by
        // the agent's.
        let answered = self.answered_at();
        let fresh = match &self.input.node.report {
            Some(Ok(r)) => {
                (r.observed_at.0 >= requested || answered.is_some_and(|a| r.observed_at.0 >= a))
                    && self.diagnosis.report_problem.is_none()
            }
            _ => !self.spec().detection.gpu_report.enabled,
        };
        let verification = &self.spec().verification;
        if fresh && self.diagnosis.is_clear() {
            // Steps keep time to the second, as the status does: the
            // moment it became clear is rounded up, never down, so that
            // stableFor is never cut short.
            let now = self.input.now;
            let since = self
                .status
                .clear_since
                .get_or_insert_with(|| Time(whole_second_after(now)))
                .0;
            let stable = after(since, verification.stable_for.as_std());
            if self.now() >= stable {
                let since = match self.diagnose(&action, stable) {
                    Ok(since) => since,
                    Err(then) => return then,
                };
                return match &verification.validation_pod {
                    Some(pod) => self.validate(&action, since, pod.timeout),
                    None => {
                        self.recovered();
                        Then::Done
                    }
                };
            }
            let left = stable
                .duration_since(self.now())
                .try_into()
                .unwrap_or(Duration::ZERO);
            self.wait(left);
            return Then::Done;
        }
        self.status.clear_since = None;
        if self.phase_age() >= verification.timeout.as_std() {
            let why = match (&self.diagnosis.report_problem, fresh) {
                (Some(problem), _) => problem.message.clone(),
                (None, true) => self.headline(),
                (None, false) => "no GPU report newer than the action".into(),
            };
            return self.attempt_failed(format!(
                "not healthy {} after {:?}: {why}",
                verification.timeout, action.type_
            ));
        }
        self.wait(POLL);
        Then::Done
    }

    /// Whether the fence over `action`'s GPUs stands while they are
    /// verified: a cordon, or a `DeviceTaintRule` for each. A device plugin
    /// offers a reset GPU again at once, and a pod placed on it then is
    /// placed where the agent put the GPU back.
    fn fenced_until_verified(&self, action: &ActionStatus) -> bool {
        match &self.status.quarantine {
            Some(q) if q.lifted_at.is_none() && q.scope == Fenced::Gpu => {
                action.gpus.iter().all(|g| {
                    q.gpus
                        .iter()
                        .any(|f| &f.uuid == g && f.fence == GpuFence::DeviceTaintRule)
                })
            }
            _ => true,
        }
    }

    /// Signals have stayed clear: the validation pod must succeed too.
    fn validate(
        &mut self,
        action: &ActionStatus,
        since: Timestamp,
        timeout: gpuhealth_api::Duration,
    ) -> Then {
        let name = validation_pod_name(&self.input.node.name, &action.id);
        let ended = |outcome| {
            Attempt::new(AttemptAction::ValidationPod, action.attempt, outcome).saying(name.clone())
        };
        match self.input.validation {
            Some(pod) if pod.phase == "Succeeded" => {
                self.actions
                    .push(Action::DeleteValidationPod { name: name.clone() });
                self.record(ended(AttemptOutcome::Succeeded));
                self.recovered();
                Then::Done
            }
            Some(pod) if pod.phase == "Failed" => {
                // Kept for its logs.
                self.record(ended(AttemptOutcome::Failed));
                self.escalate(format!(
                    "validation pod {name} failed: {}; it is kept for its logs (kubectl logs)",
                    pod.message
                ))
            }
            _ if self.now() >= after(since, timeout.as_std()) => {
                let seen = self.input.validation.is_some();
                self.actions
                    .push(Action::DeleteValidationPod { name: name.clone() });
                self.record(ended(AttemptOutcome::TimedOut));
                let why = if seen {
                    "did not succeed"
                } else {
                    "could not be created (see the node's Events)"
                };
                self.escalate(format!("validation pod {name} {why} within {timeout}"))
            }
            observed => {
                if observed.is_none() {
                    self.actions
                        .push(Action::CreateValidationPod { name: name.clone() });
                }
                self.enter(
                    Phase::Verifying,
                    Reason::Validating,
                    format!("signals clear; waiting for validation pod {name} to succeed"),
                );
                self.wait(VALIDATION_POLL);
                Then::Done
            }
        }
    }

    fn recovered(&mut self) {
        let incident = self.status.incident.clone().unwrap_or_default();
        let ours = self.ours();
        if ours {
            self.actions.push(Action::Uncordon {
                incident: incident.clone(),
            });
        }
        let fenced = self
            .status
            .quarantine
            .as_ref()
            .filter(|q| q.per_gpu())
            .map(|q| q.gpus.iter().map(gpu_name).collect::<Vec<_>>().join(", "));
        let message = if let Some(gpus) = fenced {
            format!("incident {incident} recovered; {gpus} back in service")
        } else if ours || !self.input.node.unschedulable {
            format!("incident {incident} recovered; node back in service")
        } else {
            format!(
                "incident {incident} recovered; the node stays cordoned: someone else cordoned it"
            )
        };
        self.close(IncidentOutcome::Recovered, message);
        self.lift_quarantine();
        self.start_workload_watch();
        self.status.maintenance = None;
        self.status.action = None;
        self.status.incident = None;
        self.status.clear_since = None;
        self.status.boot_id_before_reboot = None;
        self.back_in_service();
    }
}

/// `t`, or the next whole second if it falls within one.
fn whole_second_after(t: Timestamp) -> Timestamp {
    let round = jiff::TimestampRound::new()
        .smallest(jiff::Unit::Second)
        .mode(jiff::RoundMode::Ceil);
    t.round(round).unwrap_or(t)
}
