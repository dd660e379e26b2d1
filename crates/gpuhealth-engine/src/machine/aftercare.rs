//! After a recovery: are the workloads it evicted serving again? And the
//! readiness gates of the pods on the node.

use gpuhealth_api::vocabulary::FindingSubject;
use std::time::Duration;

use gpuhealth_api::{
    policy::Mode,
    vocabulary::{FindingKind, WorkloadOutcome},
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::{
    diagnosis::after,
    drain::GpuGate,
    happening::Happening,
    workload::{assess, verdict_text},
};

use crate::machine::{Action, POLL, core::Stepper, workloads_to_watch};

impl Stepper<'_> {
    /// At uncordon: the evicted workloads have until the deadline to be
    /// Ready again.
    pub(super) fn start_workload_watch(&mut self) {
        let timeout = self.spec().verification.workload_recovery_timeout;
        let now = self.now();
        let Some(w) = self
            .status
            .history
            .first_mut()
            .and_then(|i| i.workloads.as_mut())
        else {
            return;
        };
        if timeout.as_std().is_zero() {
            w.message = Some("not checked: verification.workloadRecoveryTimeout is 0s".into());
        } else {
            w.deadline = Some(Time(after(now, timeout.as_std())));
            self.wait(POLL);
        }
    }

    /// A new incident ends the last one's watch unjudged.
    pub(super) fn supersede_workload_watch(&mut self, new: &str) {
        if let Some(w) = self
            .status
            .history
            .first_mut()
            .and_then(|i| i.workloads.as_mut())
            .filter(|w| w.deadline.is_some() && w.outcome.is_none())
        {
            w.outcome = Some(WorkloadOutcome::Superseded);
            w.message = Some(format!(
                "incident {new} began before the workloads' window ended"
            ));
        }
    }

    /// After a recovery: are the evicted workloads serving again? A
    /// workload that is not is a finding about the workload (a probe too
    /// short for its cold start, a crash), never a new signal about the
    /// node: nothing here starts a remediation.
    pub(super) fn watch_workloads(&mut self) {
        let evicted = workloads_to_watch(&self.status);
        let Some(incident) = self.status.history.first() else {
            return;
        };
        let (id, Some(deadline)) = (
            incident.id.clone(),
            incident.workloads.as_ref().and_then(|w| w.deadline.clone()),
        ) else {
            return;
        };
        if evicted.is_empty() {
            return;
        }
        let mut not_serving = Vec::new();
        for name in &evicted {
            let pods = self
                .input
                .workloads
                .iter()
                .find(|v| &v.name == name)
                .map_or(&[][..], |v| v.pods.as_slice());
            let a = assess(pods);
            for c in a.too_short() {
                let pod = pods.iter().find(|p| !p.is_fine()).map(|p| p.pod.clone());
                let message = format!(
                    "{name}, evicted by incident {id}: {}",
                    verdict_text(&c.container, &c.verdict)
                );
                self.finding_about(
                    FindingKind::StartupProbeTooShort,
                    Some(FindingSubject::Workload(name.clone())),
                    message,
                    pod,
                );
            }
            if !a.recovered() {
                not_serving.push(format!("{name}: {}", a.why_not()));
            }
        }
        let now = self.now();
        let (outcome, message) = if not_serving.is_empty() {
            let message = format!(
                "every workload incident {id} evicted is Ready again: {}",
                evicted.join(", ")
            );
            self.tell(Happening::WorkloadsRecovered {
                message: message.clone(),
            });
            (WorkloadOutcome::Recovered, message)
        } else if now >= deadline.0 {
            let message = format!(
                "the node recovered, but not every workload incident {id} evicted is serving: {}",
                not_serving.join(" | ")
            );
            self.finding(
                FindingKind::WorkloadNotRecovered,
                Some(FindingSubject::Incident(id.clone())),
                message.clone(),
            );
            (WorkloadOutcome::WorkloadNotRecovered, message)
        } else {
            let left = deadline
                .0
                .duration_since(now)
                .try_into()
                .unwrap_or(Duration::ZERO);
            self.wait(left.min(POLL));
            return;
        };
        if let Some(w) = self
            .status
            .history
            .first_mut()
            .and_then(|i| i.workloads.as_mut())
        {
            w.outcome = Some(outcome);
            w.message = Some(message);
        }
    }

    /// Pods that opted in to the `gpuhealth.io/gpu-healthy` readiness gate
    /// are Ready only while their GPUs are healthy, so Services stop sending
    /// them traffic before any drain. Only an `Enforce` policy takes a pod
    /// out of service; the others keep the gate `True` so that opting in
    /// never holds a pod back.
    pub(super) fn readiness_gates(&mut self) {
        // Health unknown: leave every gate as it is.
        let Some(Ok(report)) = &self.input.node.report else {
            return;
        };
        let enforce = self.spec().mode == Mode::Enforce;
        for pod in self.input.pods {
            if pod.gpu_gate == GpuGate::NotOptedIn || pod.finished || pod.terminating {
                continue;
            }
            let bad: Vec<String> = report
                .bad_gpus()
                .filter(|g| pod.gpus.contains(&g.uuid))
                .map(|g| format!("GPU {} ({}) is {:?}", g.index, g.uuid, g.health))
                .collect();
            let healthy = bad.is_empty() || !enforce;
            if pod.gpu_gate == GpuGate::Is(healthy) {
                continue;
            }
            let message = match (bad.is_empty(), enforce) {
                (true, _) => "every GPU it holds is healthy".to_owned(),
                (false, true) => bad.join(", "),
                (false, false) => {
                    format!("{}; left True: the policy is not Enforce", bad.join(", "))
                }
            };
            self.actions.push(Action::SetGpuHealthy {
                pod: pod.key(),
                healthy,
                message,
            });
        }
    }
}
