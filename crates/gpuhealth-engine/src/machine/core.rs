//! The step in progress: what it has decided so far, and the small verbs every
//! phase uses (enter a phase, wait, record, find, tell).

use gpuhealth_api::vocabulary::FindingSubject;
use std::time::Duration;

use gpuhealth_api::{
    contract::{GPU_HEALTHY_CONDITION, RequestId},
    node_health::{FINDINGS_LIMIT, Finding, GpuStatus, Phase, ReportProblemKind},
    policy::{GpuHealthPolicySpec, Mode},
    vocabulary::{Attempt, FindingKind, IncidentOutcome, PodKey, Reason},
};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};

use crate::{
    diagnosis::{Evidence, diagnose},
    happening::Happening,
};

use super::{
    POLL,
    decision::{Action, Decision},
    input::Input,
    whole_second,
};
use crate::diagnosis::Diagnosis;
use gpuhealth_api::node_health::GpuNodeHealthStatus;

/// The step in progress.
pub(super) struct Stepper<'a> {
    pub(super) input: &'a Input<'a>,
    pub(super) status: GpuNodeHealthStatus,
    pub(super) actions: Vec<Action>,
    pub(super) happenings: Vec<Happening>,
    pub(super) requeue: Option<Duration>,
    pub(super) diagnosis: Diagnosis,
    /// The step reached the budget and was given none.
    pub(super) budget_needed: bool,
}

/// What a handler says comes next, within the same step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Then {
    /// This step is decided.
    Done,
    /// The node moved on: its new phase's handler runs too.
    Run(Stage),
}

/// A phase's handler (two for `Quarantined`/`Draining`: a maintenance
/// drain takes every pod, by rules of its own).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Stage {
    HealthyOrSuspect,
    MaintenanceDrain,
    Quarantined,
    Draining,
    AwaitingMaintenance,
    Remediating,
    Verifying,
    Failed,
}

impl<'a> Stepper<'a> {
    pub(super) fn new(input: &'a Input<'a>) -> Self {
        let mut status = input.state.clone();
        status.policy = Some(input.policy.to_owned());
        status.disrupted_by = input.node.disrupted_by.clone();
        Stepper {
            input,
            status,
            actions: Vec::new(),
            happenings: Vec::new(),
            requeue: None,
            diagnosis: Diagnosis::default(),
            budget_needed: false,
        }
    }

    pub(super) fn decision(mut self) -> Decision {
        // The fence first: it is what keeps new pods off a bad GPU.
        self.actions.sort_by_key(|a| !a.fences());
        Decision {
            status: self.status,
            actions: self.actions,
            happenings: self.happenings,
            requeue_after: self.requeue,
        }
    }

    /// Now, in whole seconds: Kubernetes stores times to the second, and a
    /// time compared with one read back from the cluster must be too.
    pub(super) fn now(&self) -> Timestamp {
        whole_second(self.input.now)
    }

    pub(super) fn spec(&self) -> &'a GpuHealthPolicySpec {
        self.input.spec
    }

    /// Xids from before the last request, its answer or what the last
    /// incident answered are history: the action since has answered them.
    pub(super) fn xids_since(&self) -> Option<Timestamp> {
        let requested = self
            .status
            .action
            .as_ref()
            .and_then(|a| a.requested_at.as_ref())
            .map(|t| t.0);
        requested
            .max(self.last_incident_answered())
            .max(self.answered_at())
    }

    /// Up to when the last incident answered Xids. One that recovered
    /// closed on a clear report read after its last request's answer: an
    /// Xid stamped after that answer (by the agent's clock) was not in that
    /// report, and is new even within the second of the close, on any GPU
    /// (the benchmark's next fault, right after a recovery, was lost to the
    /// close's own time). Otherwise, or when the Node no longer shows that
    /// answer, its end.
    fn last_incident_answered(&self) -> Option<Timestamp> {
        let last = self.status.history.first()?;
        let ended = last.ended_at.as_ref()?.0;
        let last_request = last
            .attempts
            .iter()
            .rev()
            .find(|a| a.is_remediation())
            .and_then(|a| {
                Some(RequestId::for_attempt(
                    &last.id,
                    a.action.rung()?,
                    a.attempt,
                ))
            });
        match (&self.input.node.result, last_request) {
            (Some(Ok(r)), Some(id))
                if last.outcome == Some(IncidentOutcome::Recovered) && r.id == id =>
            {
                Some(r.finished_at.0.min(ended))
            }
            _ => Some(ended),
        }
    }

    /// When the agent answered the current request, by the agent's clock:
    /// the clock its reports and Xids are stamped with, so that one running
    /// ahead of or behind the operator's cannot make answered Xids look new,
    /// nor the report after the action look old.
    pub(super) fn answered_at(&self) -> Option<Timestamp> {
        let action = self.status.action.as_ref()?;
        // The diagnostic's answer replaces the action's, and is later.
        match &self.input.node.result {
            Some(Ok(r)) if r.id == action.id || r.id == RequestId::for_diagnostics(&action.id) => {
                Some(r.finished_at.0)
            }
            _ => None,
        }
    }

    /// A finding about a bad input holds while the input is bad: it clears
    /// once the input reads again or is removed, so that the next bad value
    /// is a new finding with its own Event. The others are a record.
    fn clear_findings_of_mended_inputs(&mut self) {
        let report_bad = self.diagnosis.report_error.is_some();
        let problem = self.diagnosis.report_problem.as_ref().map(|p| p.kind);
        let notice_bad = matches!(self.input.node.maintenance, Some(Err(_)));
        self.status.findings.retain(|f| match f.type_ {
            FindingKind::MalformedGpuReport => report_bad,
            FindingKind::StaleReport => problem == Some(ReportProblemKind::Stale),
            FindingKind::GpusUnreadable => problem == Some(ReportProblemKind::Unreadable),
            FindingKind::NoReport => problem == Some(ReportProblemKind::Missing),
            FindingKind::MalformedMaintenanceNotice => notice_bad,
            _ => true,
        });
    }

    pub(super) fn observe(&mut self) {
        let node = self.input.node;
        let evidence = Evidence {
            conditions: &node.conditions,
            report: node.report.as_ref(),
            report_refreshed_at: node.report_refreshed_at,
            report_awaited_since: node.report_awaited_since,
            report_missing_before: self
                .status
                .report_problem
                .as_ref()
                .is_some_and(|p| p.kind == ReportProblemKind::Missing),
            xids_since: self.xids_since(),
            devices: node.dra.as_ref().map_or(&[], |d| d.devices.as_slice()),
            unhealthy: &node.unhealthy_devices,
            gang_window: self
                .input
                .gang_windows
                .iter()
                .find(|w| w.node != node.name && w.nodes.contains(&node.name)),
        };
        self.diagnosis = diagnose(self.now(), &self.spec().detection, &evidence);
        self.clear_findings_of_mended_inputs();
        if let Some(error) = self.diagnosis.report_error.clone() {
            self.finding(
                FindingKind::MalformedGpuReport,
                None,
                format!("the GPU report was ignored: {error}"),
            );
        }
        // Seen, never acted on: a stale or unreadable report only keeps what
        // it says from counting as a recovery.
        self.status.report_problem = self.diagnosis.report_problem.clone();
        if let Some(problem) = self.diagnosis.report_problem.clone() {
            let kind = match problem.kind {
                ReportProblemKind::Stale => FindingKind::StaleReport,
                ReportProblemKind::Unreadable => FindingKind::GpusUnreadable,
                ReportProblemKind::Missing => FindingKind::NoReport,
            };
            self.finding(kind, None, problem.message.clone());
            if problem.kind == ReportProblemKind::Missing {
                self.gpu_health_unknown(problem.message);
            }
        }
        self.tenant_findings();
        if let Some(at) = self.diagnosis.stale_at {
            self.wait(
                at.duration_since(self.now())
                    .try_into()
                    .unwrap_or(Duration::ZERO),
            );
        }
        if let Some(Ok(report)) = &node.report {
            self.status.gpus = report
                .gpus
                .iter()
                .map(|g| GpuStatus {
                    index: g.index,
                    uuid: g.uuid.clone(),
                    pci_bus_id: g.pci_bus_id.clone(),
                    health: g.health,
                    pods: g
                        .pods
                        .iter()
                        .map(|p| PodKey::new(&p.namespace, &p.name))
                        .collect(),
                })
                .collect();
            self.status.bad_gpus = report.bad_gpus().count() as u32;
            // A pod on a bad GPU can stay Ready: its probes rarely touch the GPU.
            let node = node.name.clone();
            for gpu in report.bad_gpus() {
                for p in &gpu.pods {
                    let pod = PodKey::new(&p.namespace, &p.name);
                    let message = format!(
                        "pod {pod} holds GPU {} ({}) on node {node}, which is {:?}; it may still look Ready, since its probes do not exercise the GPU",
                        gpu.index, gpu.uuid, gpu.health
                    );
                    self.finding_about(
                        FindingKind::PodOnBadGpu,
                        Some(FindingSubject::Pod(pod.clone())),
                        message,
                        Some(pod),
                    );
                }
            }
        }
    }

    /// A node with no report says so in its `GpuHealthy` condition too,
    /// for the tools that read conditions: `Unknown`, written once, and
    /// only under `Enforce` (`DryRun` and `Paused` touch nothing outside
    /// gpuhealth's own status). The agent's first report writes its own.
    fn gpu_health_unknown(&mut self, message: String) {
        let said = self
            .input
            .node
            .conditions
            .iter()
            .any(|c| c.type_ == GPU_HEALTHY_CONDITION && c.status == "Unknown");
        if said || self.spec().mode != Mode::Enforce || self.input.not_enforced.is_some() {
            return;
        }
        self.actions.push(Action::MarkGpuHealthUnknown { message });
        // A write refused as a conflict is not seen by the watch.
        self.wait(POLL);
    }

    pub(super) fn wait(&mut self, after: Duration) {
        self.requeue = Some(self.requeue.map_or(after, |r| r.min(after)));
    }

    pub(super) fn tell(&mut self, happening: Happening) {
        self.happenings.push(happening);
    }

    /// Moves to `phase` (never `Healthy`: see `back_in_service`) with a
    /// reason, said when anything changed.
    pub(super) fn enter(&mut self, phase: Phase, reason: Reason, message: String) {
        let changed = self.status.phase != phase || self.status.reason != Some(reason);
        if self.status.phase != phase {
            self.status.phase_since = Some(Time(self.now()));
        }
        self.status.phase = phase;
        if changed {
            self.tell(Happening::Entered {
                phase,
                reason,
                message: message.clone(),
            });
        }
        self.status.reason = Some(reason);
        self.status.message = Some(message);
    }

    pub(super) fn back_in_service(&mut self) {
        if self.status.phase != Phase::Healthy {
            self.status.phase_since = Some(Time(self.now()));
        }
        self.status.phase = Phase::Healthy;
        self.status.reason = None;
        self.status.message = None;
    }

    pub(super) fn phase_age(&self) -> Duration {
        let since = self.status.phase_since.as_ref().map_or(self.now(), |t| t.0);
        self.now()
            .duration_since(since)
            .try_into()
            .unwrap_or(Duration::ZERO)
    }

    pub(super) fn headline(&self) -> String {
        self.diagnosis
            .headline()
            .map_or_else(String::new, |s| s.message.clone())
    }

    pub(super) fn headline_reason(&self) -> Reason {
        self.diagnosis
            .headline()
            .map_or(Reason::Unhealthy, |s| s.reason)
    }

    pub(super) fn ours(&self) -> bool {
        self.input.node.cordoned_by.is_some() && self.input.node.cordoned_by == self.status.incident
    }

    /// Asks for the cordon again if it has not landed yet (or was undone);
    /// false until the node is cordoned.
    pub(super) fn cordoned(&mut self) -> bool {
        if self.input.node.unschedulable {
            return true;
        }
        if !self
            .actions
            .iter()
            .any(|a| matches!(a, Action::Cordon { .. }))
        {
            let incident = self.status.incident.clone().unwrap_or_default();
            self.actions.push(Action::Cordon { incident });
        }
        self.wait(POLL);
        false
    }

    pub(super) fn fail(&mut self, reason: Reason, message: String) {
        self.close(IncidentOutcome::Failed, message.clone());
        self.enter(Phase::Failed, reason, message);
    }

    /// Records a finding once (until it changes) and says so in an Event
    /// (about the node, or about the pod in `pod`).
    pub(super) fn finding(
        &mut self,
        type_: FindingKind,
        subject: Option<FindingSubject>,
        message: String,
    ) {
        self.finding_about(type_, subject, message, None);
    }

    pub(super) fn finding_about(
        &mut self,
        type_: FindingKind,
        subject: Option<FindingSubject>,
        message: String,
        pod: Option<PodKey>,
    ) {
        let known = self
            .status
            .findings
            .iter()
            .any(|f| f.type_ == type_ && f.message == message);
        if known {
            return;
        }
        self.status
            .findings
            .retain(|f| f.type_ != type_ || f.subject != subject);
        self.status.findings.insert(
            0,
            Finding {
                type_,
                subject,
                message: message.clone(),
                observed_at: Time(self.now()),
            },
        );
        self.status.findings.truncate(FINDINGS_LIMIT);
        self.tell(Happening::Found {
            kind: type_,
            message,
            pod,
        });
    }

    /// Puts an attempt on the open incident's record, and says so.
    pub(super) fn record(&mut self, attempt: Attempt) {
        if let Some(incident) = self.status.history.first_mut() {
            incident.attempts.push(attempt.clone());
            self.happenings.push(Happening::Attempted(attempt));
        }
    }

    /// Ends the open incident, and says so.
    pub(super) fn close(&mut self, outcome: IncidentOutcome, message: String) {
        let now = self.now();
        if let Some(incident) = self.status.history.first_mut()
            && incident.ended_at.is_none()
        {
            incident.ended_at = Some(Time(now));
            incident.outcome = Some(outcome);
            let lasted = now
                .duration_since(incident.started_at.0)
                .try_into()
                .unwrap_or(Duration::ZERO);
            self.happenings.push(Happening::Closed {
                outcome,
                lasted,
                message,
            });
        }
    }

    /// Holds the node in `phase` while another tool disrupts it.
    pub(super) fn held_by_other_actor(&mut self, phase: Phase) -> bool {
        if self.input.node.disrupted_by.is_empty() {
            return false;
        }
        let message = format!(
            "another tool is disrupting the node ({}); gpuhealth's next step waits until it is done",
            self.input.node.disrupted_by.join("; ")
        );
        self.enter(phase, Reason::DisruptedByOther, message);
        self.wait(POLL);
        true
    }
}
