//! The remediation state machine: one pure step from what is stored and
//! what is observed to the next stored state and the actions that get there.
//!
//! `Healthy → Suspect → Quarantined → Draining → Remediating → Verifying →
//! Healthy`, with `Failed` when escalation is exhausted. The operator writes
//! the returned status *before* carrying out the actions, so every side
//! effect is preceded by its recorded intent, and every request carries the
//! id recorded with it: a restarted operator re-issues the same request,
//! which the agent recognises, and never a second one.

use std::time::Duration;

use gpuhealth_api::{
    RecoveryAction,
    contract::{
        Capabilities, ContractError, GpuReport, MaintenanceNotice, NEEDS_REPLACEMENT_LABEL,
        Outcome, REPLACE_LABEL, RequestId, RequestResult,
    },
    node_health::{
        ActionStatus, FINDINGS_LIMIT, Finding, GpuNodeHealthStatus, GpuStatus, HISTORY_LIMIT,
        Incident, MaintenanceStatus, Phase, Plan, ReportProblemKind, WORKLOADS_LIMIT,
    },
    policy::{DrainScope, DrainTimeoutAction, EscalationStep, GpuHealthPolicySpec, Mode},
    vocabulary::{
        Attempt, AttemptAction, AttemptOutcome, FindingKind, IncidentOutcome, Reason,
        WorkloadOutcome,
    },
};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};

use crate::{
    budget::Budget,
    diagnosis::{Diagnosis, Evidence, ObservedCondition, after, diagnose},
    drain::{self, BudgetView, DrainPlan, GpuGate, PodView},
    happening::Happening,
    windows,
    workload::{WorkloadView, assess, verdict_text},
};

/// How often to look again while waiting on something that sends no event
/// of its own (a timeout, a pod finishing on a schedule).
pub const POLL: Duration = Duration::from_secs(10);

/// How often to look at a draining node's pods: a pod leaving sends no event
/// to the node, and each second a drained node waits is a second of
/// capacity lost. One field-selected pod list per draining node.
pub const DRAIN_POLL: Duration = Duration::from_secs(2);

/// How long after a request the node may still not show it without the
/// request being written again: the watch lags the write.
pub const REISSUE_AFTER: Duration = Duration::from_secs(3);

/// The node as observed.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeView {
    pub name: String,
    pub unschedulable: bool,
    /// The incident named by `gpuhealth.io/cordoned-by`, if gpuhealth cordoned it.
    pub cordoned_by: Option<String>,
    pub boot_id: String,
    pub conditions: Vec<ObservedCondition>,
    pub report: Option<Result<GpuReport, ContractError>>,
    /// The ids of the request annotations now on the node.
    pub reset_request: Option<RequestId>,
    pub reboot_request: Option<RequestId>,
    pub result: Option<Result<RequestResult, ContractError>>,
    /// Other tools disrupting the node now, in words (see `others`).
    pub disrupted_by: Vec<String>,
    /// The `gpuhealth.io/maintenance` notice, if any.
    pub maintenance: Option<Result<MaintenanceNotice, ContractError>>,
    /// When the operator first saw the report as it is (a new `observedAt`),
    /// by the operator's clock: a report's age is judged on it, whatever the
    /// agent's clock says. None: the report's own time is taken.
    pub report_refreshed_at: Option<Timestamp>,
    /// The reason an administrator gave in `gpuhealth.io/break-glass` when
    /// clearing a request or the cordon record by hand.
    pub break_glass: Option<String>,
}

/// The validation pod of the attempt in flight, as observed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValidationView {
    /// `status.phase`: `Pending`, `Running`, `Succeeded` or `Failed`.
    pub phase: String,
    /// Why it ended, from its status or its containers' termination.
    pub message: String,
}

/// The validation pod's name for an attempt on a node: one per attempt, so
/// a restarted operator finds the pod it created and a new attempt starts afresh.
pub fn validation_pod_name(node: &str, action_id: &RequestId) -> String {
    let mut name = format!("gpuhealth-validate-{node}-{action_id}");
    name.truncate(253);
    name.trim_end_matches(['-', '.']).to_owned()
}

/// How often to look at a running validation pod: its progress sends no
/// event to the node.
pub const VALIDATION_POLL: Duration = Duration::from_secs(2);

/// Everything one step decides on.
pub struct Input<'a> {
    pub now: Timestamp,
    pub policy: &'a str,
    pub spec: &'a GpuHealthPolicySpec,
    pub node: &'a NodeView,
    /// The pods on the node; listed only while the node is under remediation.
    pub pods: &'a [PodView],
    /// The PodDisruptionBudgets covering those pods; read only for a
    /// `DryRun` plan (during a drain the Eviction API applies them).
    pub disruption_budgets: &'a [BudgetView],
    /// The validation pod of the attempt in flight, if the policy has one
    /// and it exists.
    pub validation: Option<&'a ValidationView>,
    /// The pods, wherever they run, of the workloads named by
    /// [`workloads_to_watch`]; empty otherwise.
    pub workloads: &'a [WorkloadView],
    pub budget: Budget,
    pub state: &'a GpuNodeHealthStatus,
}

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
    /// Evict through the Eviction API (PodDisruptionBudgets hold).
    Evict {
        pod: String,
    },
    /// Delete with no grace, bypassing budgets: only where the policy says so.
    ForceDelete {
        pod: String,
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
        pod: String,
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

/// Whether a phase holds a node out of service on gpuhealth's account (what
/// `maxConcurrent` counts).
pub fn is_disruptive(phase: Phase) -> bool {
    matches!(
        phase,
        Phase::Quarantined
            | Phase::Draining
            | Phase::Remediating
            | Phase::AwaitingMaintenance
            | Phase::Verifying
    )
}

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

pub fn step(input: &Input<'_>) -> Decision {
    let mut s = Stepper {
        input,
        status: input.state.clone(),
        actions: Vec::new(),
        happenings: Vec::new(),
        requeue: None,
        diagnosis: Diagnosis::default(),
    };
    s.status.policy = Some(input.policy.to_owned());
    s.status.disrupted_by = input.node.disrupted_by.clone();
    s.observe();
    s.readiness_gates();
    if let Some(reason) = &input.node.break_glass {
        // Nothing else this round: the next starts from what it left.
        s.break_glass(reason);
        return s.decision();
    }
    let mode = input.spec.mode;
    if mode != Mode::Enforce
        && !matches!(
            input.state.phase,
            Phase::Healthy | Phase::Suspect | Phase::Failed
        )
    {
        // Switched to DryRun or Paused mid-remediation: hold where we are and
        // touch nothing outside our own status until Enforce again.
        let message = format!(
            "policy mode is {mode:?}: remediation held in {:?}",
            input.state.phase
        );
        s.status.reason = Some(Reason::Held);
        s.status.message = Some(message);
        s.requeue = None;
        return s.decision();
    }
    match input.state.phase {
        Phase::Healthy | Phase::Suspect => s.healthy_or_suspect(),
        Phase::Quarantined | Phase::Draining if input.state.maintenance.is_some() => {
            s.maintenance_drain()
        }
        // An attempt recorded but held back (by a maintenance window):
        // carry on with it rather than decide a new one.
        Phase::Quarantined
            if input
                .state
                .action
                .as_ref()
                .is_some_and(|a| a.requested_at.is_none()) =>
        {
            s.draining()
        }
        Phase::Quarantined => s.quarantined(),
        Phase::Draining => s.draining(),
        Phase::AwaitingMaintenance => s.awaiting_maintenance(),
        Phase::Remediating => s.remediating(),
        Phase::Verifying => s.verifying(),
        Phase::Failed => s.failed(),
    }
    s.decision()
}

struct Stepper<'a> {
    input: &'a Input<'a>,
    status: GpuNodeHealthStatus,
    actions: Vec<Action>,
    happenings: Vec<Happening>,
    requeue: Option<Duration>,
    diagnosis: Diagnosis,
}

impl<'a> Stepper<'a> {
    fn decision(mut self) -> Decision {
        // The cordon first: it is what keeps new pods off a bad GPU.
        self.actions
            .sort_by_key(|a| !matches!(a, Action::Cordon { .. }));
        Decision {
            status: self.status,
            actions: self.actions,
            happenings: self.happenings,
            requeue_after: self.requeue,
        }
    }

    /// An administrator cleared a request or gpuhealth's cordon record by
    /// hand (admission lets them only with a reason): a request in flight is
    /// abandoned, never re-issued, and the node is left to them, cordoned,
    /// as after any failure. Their reason is a finding (an Event, and
    /// `gpuhealth_findings_total{type="BreakGlass"}`) either way.
    fn break_glass(&mut self, reason: &str) {
        self.actions.push(Action::ClearBreakGlass);
        let in_flight = self
            .status
            .action
            .clone()
            .filter(|a| self.status.phase == Phase::Remediating && a.requested_at.is_some());
        let what = match &in_flight {
            Some(a) => format!(
                "{:?} attempt {} ({}) abandoned, never re-issued; the node stays cordoned for you: repair it, then uncordon",
                a.type_, a.attempt, a.id
            ),
            None => format!(
                "no request was in flight ({:?}); nothing else changed",
                self.status.phase
            ),
        };
        self.finding(
            FindingKind::BreakGlass,
            None,
            format!("cleared by hand, gpuhealth.io/break-glass: {reason:?}: {what}"),
        );
        if let Some(a) = in_flight {
            self.record(
                Attempt::new(a.type_, a.attempt, AttemptOutcome::Cancelled).saying("by hand"),
            );
            self.fail(
                Reason::BreakGlass,
                format!(
                    "an administrator cleared {} by hand ({reason:?}); {what}",
                    a.id
                ),
            );
        }
    }

    /// Now, in whole seconds: Kubernetes stores times to the second, and a
    /// time compared with one read back from the cluster must be too.
    fn now(&self) -> Timestamp {
        whole_second(self.input.now)
    }

    fn spec(&self) -> &'a GpuHealthPolicySpec {
        self.input.spec
    }

    /// Xids from before the last request, its answer or the end of the last
    /// incident are history: the action since has answered them.
    fn xids_since(&self) -> Option<Timestamp> {
        let requested = self
            .status
            .action
            .as_ref()
            .and_then(|a| a.requested_at.as_ref())
            .map(|t| t.0);
        let ended = self
            .status
            .history
            .first()
            .and_then(|i| i.ended_at.as_ref())
            .map(|t| t.0);
        requested.max(ended).max(self.answered_at())
    }

    /// When the agent answered the current request, by the agent's clock:
    /// the clock its reports and Xids are stamped with, so that one running
    /// ahead of or behind the operator's cannot make answered Xids look new,
    /// nor the report after the action look old.
    fn answered_at(&self) -> Option<Timestamp> {
        let action = self.status.action.as_ref()?;
        match &self.input.node.result {
            Some(Ok(r)) if r.id == action.id => Some(r.finished_at.0),
            _ => None,
        }
    }

    fn observe(&mut self) {
        let node = self.input.node;
        let evidence = Evidence {
            conditions: &node.conditions,
            report: node.report.as_ref(),
            report_refreshed_at: node.report_refreshed_at,
            xids_since: self.xids_since(),
        };
        self.diagnosis = diagnose(self.now(), &self.spec().detection, &evidence);
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
            };
            self.finding(kind, None, problem.message);
        }
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
                        .map(|p| format!("{}/{}", p.namespace, p.name))
                        .collect(),
                })
                .collect();
            self.status.bad_gpus = report.bad_gpus().count() as u32;
            // A pod on a bad GPU can stay Ready: its probes rarely touch the GPU.
            let node = node.name.clone();
            for gpu in report.bad_gpus() {
                for p in &gpu.pods {
                    let pod = format!("{}/{}", p.namespace, p.name);
                    let message = format!(
                        "pod {pod} holds GPU {} ({}) on node {node}, which is {:?}; it may still look Ready, since its probes do not exercise the GPU",
                        gpu.index, gpu.uuid, gpu.health
                    );
                    self.finding_about(
                        FindingKind::PodOnBadGpu,
                        Some(pod.clone()),
                        message,
                        Some(pod),
                    );
                }
            }
        }
    }

    fn wait(&mut self, after: Duration) {
        self.requeue = Some(self.requeue.map_or(after, |r| r.min(after)));
    }

    fn tell(&mut self, happening: Happening) {
        self.happenings.push(happening);
    }

    /// Moves to `phase` (never `Healthy`: see `back_in_service`) with a
    /// reason, said when anything changed.
    fn enter(&mut self, phase: Phase, reason: Reason, message: String) {
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

    fn back_in_service(&mut self) {
        if self.status.phase != Phase::Healthy {
            self.status.phase_since = Some(Time(self.now()));
        }
        self.status.phase = Phase::Healthy;
        self.status.reason = None;
        self.status.message = None;
    }

    fn phase_age(&self) -> Duration {
        let since = self.status.phase_since.as_ref().map_or(self.now(), |t| t.0);
        self.now()
            .duration_since(since)
            .try_into()
            .unwrap_or(Duration::ZERO)
    }

    fn healthy_or_suspect(&mut self) {
        self.status.plan = None;
        self.watch_workloads();
        let notice = self.maintenance_due();
        let required = self.diagnosis.required();
        if required.is_none() && notice.is_none() {
            match self.diagnosis.pending_until {
                Some(at) => {
                    let left = at
                        .duration_since(self.now())
                        .try_into()
                        .unwrap_or(Duration::ZERO);
                    self.enter(
                        Phase::Suspect,
                        Reason::SignalPending,
                        "a signal holds but not yet for its `for` duration".into(),
                    );
                    self.wait(left);
                }
                None => {
                    if let Some(incident) = self.leftover_cordon() {
                        self.actions.push(Action::Uncordon { incident });
                    }
                    self.back_in_service()
                }
            }
            return;
        }
        let headline = match &notice {
            Some(n) => maintenance_headline(n),
            None => self.headline(),
        };
        if self.spec().mode == Mode::Paused {
            self.enter(
                Phase::Suspect,
                Reason::Paused,
                format!("policy is Paused; would act on: {headline}"),
            );
            return;
        }
        if !self.input.node.disrupted_by.is_empty() {
            self.enter(
                Phase::Suspect,
                Reason::DisruptedByOther,
                format!(
                    "another tool is disrupting the node ({}); gpuhealth starts nothing until it is done; waiting to act on: {headline}",
                    self.input.node.disrupted_by.join("; ")
                ),
            );
            self.wait(POLL);
            return;
        }
        if let Err(hold) = self.input.budget.may_start() {
            let b = self.input.budget;
            let why = match hold {
                crate::budget::Hold::CircuitOpen => format!(
                    "{} of the policy's nodes are unhealthy, more than maxUnhealthy allows ({}); no new remediation starts",
                    b.unhealthy, b.max_unhealthy
                ),
                crate::budget::Hold::Concurrency => format!(
                    "{} node(s) already being remediated and {} disrupted by other tools (maxConcurrent {})",
                    b.disruptive_elsewhere, b.disrupted_by_others, b.max_concurrent
                ),
            };
            self.enter(
                Phase::Suspect,
                hold.reason(),
                format!("{why}; waiting to act on: {headline}"),
            );
            self.wait(POLL);
            return;
        }
        if self.spec().mode == Mode::DryRun {
            let (action, what) = match (&notice, required) {
                (Some(_), _) | (None, None) => (
                    RecoveryAction::NodeReboot,
                    "drain for maintenance".to_owned(),
                ),
                (None, Some(r)) => (r, format!("{r:?}")),
            };
            self.status.plan = Some(self.dry_run_plan(action));
            self.enter(
                Phase::Suspect,
                Reason::DryRun,
                format!("DryRun: would quarantine and {what} for: {headline}"),
            );
            return;
        }
        if let Some(notice) = notice {
            self.open_incident(headline.clone(), Vec::new(), Some(notice.deadline.clone()));
            self.status.maintenance = Some(MaintenanceStatus {
                deadline: notice.deadline,
                source: notice.source,
                reason: notice.reason,
                drained_at: None,
            });
            self.enter(
                Phase::Quarantined,
                Reason::MaintenanceScheduled,
                format!("cordoned ahead of {headline}"),
            );
            return;
        }
        let gpus = self.diagnosis.gpus();
        if let Some(why) = self.repeat_offender(&gpus) {
            self.open_incident(headline.clone(), gpus, None);
            self.actions.push(Action::LabelNode {
                key: NEEDS_REPLACEMENT_LABEL.into(),
                value: "true".into(),
            });
            return self.fail(
                Reason::RepeatedFailures,
                format!(
                    "{why}: handed over for replacement instead of another remediation; the node stays cordoned and is labelled {NEEDS_REPLACEMENT_LABEL}=true (now: {headline})"
                ),
            );
        }
        self.open_incident(headline.clone(), gpus, None);
        self.enter(
            Phase::Quarantined,
            self.headline_reason(),
            format!("cordoned for: {headline}"),
        );
    }

    /// Starts an incident: recorded first, then the cordon (unless the
    /// node is cordoned already by anyone else; a cordon of ours left from
    /// the last incident is taken over by this one).
    fn open_incident(
        &mut self,
        trigger: String,
        gpus: Vec<String>,
        maintenance_deadline: Option<Time>,
    ) {
        let leftover = self.leftover_cordon();
        let incident = format!("inc-{}", self.now().as_second());
        self.supersede_workload_watch(&incident);
        self.status.incident = Some(incident.clone());
        self.status.action = None;
        self.status.clear_since = None;
        self.status.history.insert(
            0,
            Incident {
                id: incident.clone(),
                started_at: Time(self.now()),
                ended_at: None,
                trigger,
                attempts: Vec::new(),
                actions: Vec::new(),
                outcome: None,
                gpus,
                maintenance_deadline,
                workloads: None,
            },
        );
        self.status.history.truncate(HISTORY_LIMIT);
        if !self.input.node.unschedulable || leftover.is_some() {
            self.actions.push(Action::Cordon { incident });
            // Only a report that shows the fault dates it: a cordon for a node
            // condition or a maintenance notice says nothing of reaction time.
            if let Some(Ok(report)) = &self.input.node.report
                && report.bad_gpus().next().is_some()
            {
                let observed_at = report.observed_at.0;
                self.tell(Happening::CordonedForReport { observed_at });
            }
        }
    }

    /// Our cordon from an incident that ended with the node back in service
    /// (its record still on the node, no incident open): the uncordon was
    /// decided and recorded but did not land (refused as a conflict, or the
    /// operator stopped between the two). The incident's id, if so; only
    /// under Enforce, since finishing it is a side effect.
    fn leftover_cordon(&self) -> Option<String> {
        if self.spec().mode != Mode::Enforce {
            return None;
        }
        let last = self.status.history.first()?;
        let ended_in_service = matches!(
            last.outcome,
            Some(IncidentOutcome::Recovered | IncidentOutcome::Cancelled)
        );
        let node = self.input.node;
        (self.status.incident.is_none()
            && ended_in_service
            && node.unschedulable
            && node.cordoned_by.as_deref() == Some(last.id.as_str()))
        .then(|| last.id.clone())
    }

    /// Whether this GPU or node was remediated as often as the policy
    /// allows in its window; why, if so.
    fn repeat_offender(&self, gpus: &[String]) -> Option<String> {
        let limits = &self.spec().remediation_limits;
        let since = self
            .now()
            .checked_sub(k8s_openapi::jiff::SignedDuration::try_from(limits.window.as_std()).ok()?)
            .ok()?;
        // Remediations that acted: not maintenance, not a hand-over.
        let recent: Vec<&Incident> = self
            .status
            .history
            .iter()
            .filter(|i| i.started_at.0 >= since && !i.attempts.is_empty())
            .filter(|i| i.maintenance_deadline.is_none())
            .collect();
        if limits.per_node > 0 && recent.len() >= limits.per_node as usize {
            return Some(format!(
                "the node was remediated {} times in the last {} (remediationLimits.perNode {})",
                recent.len(),
                limits.window,
                limits.per_node
            ));
        }
        gpus.iter().find_map(|g| {
            let count = recent.iter().filter(|i| i.gpus.contains(g)).count();
            (limits.per_gpu > 0 && count >= limits.per_gpu as usize).then(|| {
                format!(
                    "GPU {g} was remediated {count} times in the last {} (remediationLimits.perGpu {})",
                    limits.window, limits.per_gpu
                )
            })
        })
    }

    /// A maintenance notice to act on now: its lead time has come, or a GPU
    /// failed before it and the policy leaves the repair to the provider.
    fn maintenance_due(&mut self) -> Option<MaintenanceNotice> {
        let policy = self.spec().maintenance.clone();
        if !policy.enabled {
            return None;
        }
        let mut notice = match &self.input.node.maintenance {
            Some(Ok(n)) => n.clone(),
            Some(Err(e)) => {
                let message = format!("the maintenance notice was ignored: {e}");
                self.finding(FindingKind::MalformedMaintenanceNotice, None, message);
                return None;
            }
            None => return None,
        };
        // Kubernetes stores times to the second: the deadline recorded in
        // status must compare equal to the notice's when read back.
        notice.deadline = Time(whole_second(notice.deadline.0));
        let handled = self
            .status
            .history
            .iter()
            .any(|i| i.maintenance_deadline.as_ref() == Some(&notice.deadline));
        if handled {
            return None;
        }
        let now = self.now();
        if now >= notice.deadline.0 {
            let message = format!(
                "{} passed before gpuhealth drained the node: if the provider has not acted yet it may at any moment; once the work is done, remove the gpuhealth.io/maintenance annotation",
                maintenance_headline(&notice)
            );
            self.finding(
                FindingKind::MaintenanceDeadlinePassed,
                Some(notice.source.clone()),
                message,
            );
            return None;
        }
        let drain_from = notice
            .deadline
            .0
            .checked_sub(
                k8s_openapi::jiff::SignedDuration::try_from(policy.lead_time.as_std()).ok()?,
            )
            .ok()?;
        let gpu_waits = self.diagnosis.required().is_some() && !policy.remediate_before;
        if now >= drain_from || gpu_waits {
            return Some(notice);
        }
        let left = drain_from
            .duration_since(now)
            .try_into()
            .unwrap_or(Duration::ZERO);
        self.wait(left);
        None
    }

    fn headline(&self) -> String {
        self.diagnosis
            .headline()
            .map_or_else(String::new, |s| s.message.clone())
    }

    fn headline_reason(&self) -> Reason {
        self.diagnosis
            .headline()
            .map_or(Reason::Unhealthy, |s| s.reason)
    }

    fn ours(&self) -> bool {
        self.input.node.cordoned_by.is_some() && self.input.node.cordoned_by == self.status.incident
    }

    /// Asks for the cordon again if it has not landed yet (or was undone);
    /// false until the node is cordoned.
    fn cordoned(&mut self) -> bool {
        if self.input.node.unschedulable {
            return true;
        }
        let incident = self.status.incident.clone().unwrap_or_default();
        self.actions.push(Action::Cordon { incident });
        self.wait(POLL);
        false
    }

    fn quarantined(&mut self) {
        if !self.cordoned() {
            return;
        }
        if self.held_by_other_actor(Phase::Quarantined) || self.cooling_down() {
            return;
        }
        let required = self
            .diagnosis
            .required()
            .unwrap_or(RecoveryAction::GpuReset);
        let ladder = &self.spec().escalation;
        let rung = ladder
            .iter()
            .position(|r| r.action >= required)
            .unwrap_or(ladder.len().saturating_sub(1));
        self.start_attempt(rung, 1);
    }

    /// What the node's agent says it can carry out, if it says.
    fn capabilities(&self) -> Option<Capabilities> {
        match &self.input.node.report {
            Some(Ok(report)) => report.capabilities,
            _ => None,
        }
    }

    /// Why the node's agent cannot carry out `action`, if it cannot: that
    /// rung is passed over rather than requested and refused.
    fn unavailable(&self, action: RecoveryAction) -> Option<String> {
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

    /// Records the next attempt (intent first) and moves to draining for it.
    fn start_attempt(&mut self, rung: usize, attempt: u32) {
        let Some(step) = self.spec().escalation.get(rung).cloned() else {
            return self.exhausted();
        };
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
        self.draining();
    }

    /// The GPUs a reset names: those the signals name now; else those the
    /// last attempt or the incident named (the fault may have cleared since,
    /// as a transient one does); else every GPU the report lists, since a
    /// signal that names no GPU concerns them all.
    fn gpus_to_reset(&self) -> Vec<String> {
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

    fn drain_scope(&self, action: RecoveryAction) -> DrainScope {
        // A reboot takes every pod down with the node.
        if action >= RecoveryAction::NodeReboot {
            DrainScope::AllPods
        } else {
            self.spec().drain.scope
        }
    }

    fn drain_plan(&self, action: RecoveryAction, gpus: &[String]) -> DrainPlan {
        let mut scope = self.drain_scope(action);
        let unknown = self.holders_unknown(gpus);
        if scope == DrainScope::AffectedPods && unknown.is_some() {
            scope = DrainScope::GpuPods;
        }
        let mut plan = drain::plan(&self.spec().drain, scope, gpus, self.input.pods);
        if scope == DrainScope::GpuPods && self.spec().drain.scope == DrainScope::AffectedPods {
            plan.widened = unknown.map(|why| {
                format!("every GPU pod of the node is drained, not only the GPUs' holders: {why}")
            });
        }
        plan
    }

    /// Why the pods holding `gpus` (every GPU when none is named) are not
    /// known, if the report says they are not.
    fn holders_unknown(&self, gpus: &[String]) -> Option<String> {
        let Some(Ok(report)) = &self.input.node.report else {
            return None;
        };
        report
            .gpus
            .iter()
            .filter(|g| gpus.is_empty() || gpus.contains(&g.uuid))
            .find_map(|g| {
                g.pods_unknown
                    .as_ref()
                    .map(|why| format!("who holds GPU {} is not known ({why})", g.index))
            })
    }

    fn dry_run_plan(&self, required: RecoveryAction) -> Plan {
        let ladder = &self.spec().escalation;
        // The rungs from the first strong enough (else the last), less
        // those the agent cannot carry out.
        let from = ladder
            .iter()
            .position(|r| r.action >= required)
            .unwrap_or(ladder.len().saturating_sub(1));
        let mut skipped = Vec::new();
        let action =
            ladder
                .iter()
                .skip(from)
                .map(|r| r.action)
                .find(|a| match self.unavailable(*a) {
                    Some(why) => {
                        skipped.push(format!("{a:?}: {why}"));
                        false
                    }
                    None => true,
                });
        let gpus = self.diagnosis.gpus();
        let drain = action
            .map(|a| self.drain_plan(a, &gpus))
            .unwrap_or_default();
        let disruption_budgets = self
            .input
            .disruption_budgets
            .iter()
            .filter_map(|b| b.against(&drain.evict))
            .collect();
        Plan {
            cordon: !self.input.node.unschedulable,
            action,
            gpus,
            evict: drain.evict,
            wait_for: drain.waiting,
            blocked_by: drain
                .blocked
                .into_iter()
                .map(|(pod, why)| format!("{pod}: {why}"))
                .collect(),
            disruption_budgets,
            widened: drain.widened,
            skipped,
        }
    }

    fn draining(&mut self) {
        let Some(action) = self.status.action.clone() else {
            // Draining with no attempt recorded: decide one afresh.
            return self.quarantined();
        };
        if self.held_by_other_actor(Phase::Draining) {
            return;
        }
        let plan = self.drain_plan(action.type_, &action.gpus);
        if self.disrupts_healthy_gpus(action.type_, &action.gpus, &plan)
            && let Some(why) = self.outside_window()
        {
            // Cordoned, nothing evicted yet: the drain's timeout starts
            // when the drain does.
            self.enter(Phase::Quarantined, Reason::OutsideMaintenanceWindow, why);
            return;
        }
        if plan.is_done() {
            return self.request(action);
        }
        self.drain(plan, Reason::Draining);
    }

    /// One round of a drain that is not done: evict what may go, wait for
    /// the rest, and fail or force at `drain.timeout`.
    fn drain(&mut self, plan: DrainPlan, reason: Reason) {
        let drain = &self.spec().drain;
        // Counted from the start of this drain: time held back before it
        // (cordoned, outside a window) is not the pods' fault.
        let timed_out =
            self.status.phase == Phase::Draining && self.phase_age() >= drain.timeout.as_std();
        if timed_out && drain.on_timeout == DrainTimeoutAction::ForceDelete {
            for pod in plan.evict.iter().chain(&plan.waiting) {
                self.note_evicted(pod);
                self.actions.push(Action::ForceDelete { pod: pod.clone() });
            }
        } else if timed_out {
            let left: Vec<String> = plan
                .evict
                .iter()
                .chain(&plan.waiting)
                .cloned()
                .chain(plan.blocked.iter().map(|(p, why)| format!("{p} ({why})")))
                .collect();
            return self.fail(
                Reason::DrainTimeout,
                format!(
                    "pods still on the node after drain.timeout {}: {}; the node stays cordoned: move or delete them, then uncordon",
                    drain.timeout,
                    left.join(", ")
                ),
            );
        } else {
            for pod in &plan.evict {
                self.note_evicted(pod);
                self.actions.push(Action::Evict { pod: pod.clone() });
            }
        }
        match plan.blocked.first() {
            Some((pod, why)) => {
                let message = format!("waiting for pod {pod} to leave: {why}");
                self.enter(Phase::Draining, Reason::WaitingForPod, message);
            }
            None => {
                let mut message = format!(
                    "{} to evict, {} to finish",
                    plan.evict.len(),
                    plan.waiting.len()
                );
                if let Some(why) = &plan.widened {
                    message.push_str(&format!("; {why}"));
                }
                self.enter(Phase::Draining, reason, message);
            }
        }
        self.wait(DRAIN_POLL);
    }

    /// Holds the node in `phase` while another tool disrupts it.
    fn held_by_other_actor(&mut self, phase: Phase) -> bool {
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

    /// Holds the node cordoned until the cooldown after its last
    /// remediation has passed.
    fn cooling_down(&mut self) -> bool {
        let cooldown = self.spec().remediation_limits.cooldown;
        let Some(ended) = self
            .status
            .history
            .get(1)
            .and_then(|i| i.ended_at.as_ref())
            .map(|t| t.0)
        else {
            return false;
        };
        let until = after(ended, cooldown.as_std());
        if cooldown.as_std().is_zero() || self.now() >= until {
            return false;
        }
        let message = format!(
            "the last remediation of this node ended at {ended}; the next waits for remediationLimits.cooldown {cooldown}, until {until}"
        );
        self.enter(Phase::Quarantined, Reason::Cooldown, message);
        let left = until
            .duration_since(self.now())
            .try_into()
            .unwrap_or(Duration::ZERO);
        self.wait(left);
        true
    }

    /// Whether a step takes down GPUs that are not broken: a reboot, or
    /// evicting a pod that holds no GPU the action is about.
    fn disrupts_healthy_gpus(
        &self,
        action: RecoveryAction,
        gpus: &[String],
        plan: &DrainPlan,
    ) -> bool {
        if action >= RecoveryAction::NodeReboot {
            return true;
        }
        if gpus.is_empty() {
            // Every GPU of the node is concerned.
            return false;
        }
        plan.evict.iter().chain(&plan.waiting).any(|key| {
            self.input
                .pods
                .iter()
                .find(|p| &p.key() == key)
                .is_some_and(|p| !p.gpus.iter().any(|g| gpus.contains(g)))
        })
    }

    /// Why a step that disrupts healthy GPUs must wait now, if it must.
    fn outside_window(&mut self) -> Option<String> {
        let windows_ = &self.spec().maintenance_windows;
        let why = match windows::is_open(windows_, self.now()) {
            Ok(true) => return None,
            Ok(false) => match windows::next_opening(windows_, self.now()) {
                Some(at) => {
                    let left = at
                        .duration_since(self.now())
                        .try_into()
                        .unwrap_or(Duration::ZERO);
                    self.wait(left.min(POLL));
                    format!("the next maintenance window opens at {at}")
                }
                None => {
                    self.wait(POLL);
                    "no maintenance window opens within a week".into()
                }
            },
            Err(e) => {
                self.wait(POLL);
                format!("the policy's maintenanceWindows cannot be read ({e}); fix the policy")
            }
        };
        Some(format!(
            "this step disrupts GPUs that are not broken (a reboot, or pods on healthy GPUs), which the policy allows only in its maintenance windows; {why}"
        ))
    }

    /// Quarantined or draining ahead of a scheduled maintenance: every pod
    /// leaves (the provider takes the whole node), by the same rules.
    fn maintenance_drain(&mut self) {
        if self.maintenance_withdrawn() {
            return self.maintenance_cancelled();
        }
        if !self.cordoned() {
            return;
        }
        let phase = self.status.phase;
        if self.held_by_other_actor(phase) {
            return;
        }
        let plan = drain::plan(
            &self.spec().drain,
            DrainScope::AllPods,
            &[],
            self.input.pods,
        );
        if !plan.is_done() {
            return self.drain(plan, Reason::DrainingForMaintenance);
        }
        let now = self.now();
        let Some(m) = self.status.maintenance.as_mut() else {
            return self.quarantined();
        };
        m.drained_at = Some(Time(now));
        let message = format!(
            "drained; waiting for {}'s maintenance, due {}: {}",
            m.source, m.deadline.0, m.reason
        );
        self.status.boot_id_before_reboot = Some(self.input.node.boot_id.clone());
        self.record(Attempt::new(
            AttemptAction::Maintenance,
            1,
            AttemptOutcome::Drained,
        ));
        self.enter(
            Phase::AwaitingMaintenance,
            Reason::AwaitingMaintenance,
            message,
        );
        self.wait(POLL);
    }

    /// Drained and waiting: the provider's work shows as a new boot id.
    fn awaiting_maintenance(&mut self) {
        let Some(m) = self.status.maintenance.clone() else {
            return self.quarantined();
        };
        let node = self.input.node;
        let rebooted = self
            .status
            .boot_id_before_reboot
            .as_deref()
            .is_some_and(|b| b != node.boot_id);
        if rebooted {
            let incident = self.status.incident.clone().unwrap_or_default();
            let now = self.now();
            let action = ActionStatus {
                id: RequestId::for_maintenance(&incident),
                type_: RecoveryAction::NodeReboot,
                attempt: 1,
                gpus: Vec::new(),
                started_at: m.drained_at.clone().unwrap_or(Time(now)),
                requested_at: Some(Time(now)),
                deadline: None,
            };
            self.record(
                Attempt::new(AttemptAction::Maintenance, 1, AttemptOutcome::Succeeded)
                    .saying("new boot id"),
            );
            self.status.action = Some(action);
            self.status.clear_since = None;
            self.enter(
                Phase::Verifying,
                Reason::Verifying,
                "back from maintenance; waiting for every signal to stay clear".into(),
            );
            return self.verifying();
        }
        if self.maintenance_withdrawn() {
            return self.maintenance_cancelled();
        }
        let overdue = after(m.deadline.0, self.spec().maintenance.overdue_after.as_std());
        if self.now() >= overdue {
            let message = format!(
                "drained for {}'s maintenance due {}, but the node has not been taken down (same boot id) by {overdue}; it stays cordoned: ask the provider, or remove the gpuhealth.io/maintenance annotation to return it to service",
                m.source, m.deadline.0
            );
            self.finding(
                FindingKind::MaintenanceOverdue,
                Some(m.source.clone()),
                message,
            );
        } else {
            let left = overdue
                .duration_since(self.now())
                .try_into()
                .unwrap_or(Duration::ZERO);
            self.wait(left);
        }
        self.wait(POLL);
    }

    /// The notice being handled is gone from the node (or replaced).
    fn maintenance_withdrawn(&self) -> bool {
        let handled = self.status.maintenance.as_ref().map(|m| m.deadline.0);
        match &self.input.node.maintenance {
            Some(Ok(n)) => Some(whole_second(n.deadline.0)) != handled,
            // A malformed notice is ignored, never acted on: as if withdrawn.
            _ => true,
        }
    }

    fn maintenance_cancelled(&mut self) {
        let incident = self.status.incident.clone().unwrap_or_default();
        if self.ours() {
            self.actions.push(Action::Uncordon {
                incident: incident.clone(),
            });
        }
        self.close(
            IncidentOutcome::Cancelled,
            format!(
                "incident {incident}: the maintenance notice was withdrawn; node back in service"
            ),
        );
        self.status.maintenance = None;
        self.status.action = None;
        self.status.incident = None;
        self.status.boot_id_before_reboot = None;
        self.back_in_service();
    }

    fn request(&mut self, mut action: ActionStatus) {
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
            RecoveryAction::GpuReset => {
                self.actions.push(Action::RequestReset {
                    id: action.id.clone(),
                    gpus: action.gpus.clone(),
                    requested_at: now,
                });
            }
            RecoveryAction::NodeReboot => {
                self.status.boot_id_before_reboot = Some(self.input.node.boot_id.clone());
                self.actions.push(Action::RequestReboot {
                    id: action.id.clone(),
                    requested_at: now,
                });
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
                return self.fail(
                    Reason::ReplacementRequested,
                    "handed off for replacement: the node stays cordoned and is labelled gpuhealth.io/replace".into(),
                );
            }
        }
        let message = format!(
            "{:?} attempt {} requested ({})",
            action.type_, action.attempt, action.id
        );
        self.status.action = Some(action);
        self.enter(Phase::Remediating, Reason::ActionRequested, message);
        self.wait(timeout.min(POLL));
    }

    fn rung(&self, action: RecoveryAction) -> Option<&EscalationStep> {
        self.spec().escalation.iter().find(|r| r.action == action)
    }

    fn remediating(&mut self) {
        let Some(action) = self.status.action.clone() else {
            return self.quarantined();
        };
        let node = self.input.node;
        let result = match &node.result {
            Some(Ok(r)) if r.id == action.id => Some(r),
            _ => None,
        };
        match (action.type_, result) {
            (_, Some(r)) if r.outcome != Outcome::Succeeded => {
                return self
                    .attempt_failed(format!("{:?} {:?}: {}", action.type_, r.outcome, r.message));
            }
            (RecoveryAction::GpuReset, Some(_)) => return self.begin_verifying(&action),
            (RecoveryAction::NodeReboot, _)
                if self
                    .status
                    .boot_id_before_reboot
                    .as_deref()
                    .is_some_and(|b| b != node.boot_id) =>
            {
                return self.begin_verifying(&action);
            }
            _ => {}
        }
        if action.deadline.as_ref().is_some_and(|d| self.now() >= d.0) {
            return self.attempt_failed(format!(
                "{:?} attempt {} timed out",
                action.type_, action.attempt
            ));
        }
        // Re-issue the same request if its annotation is not on the node
        // (an operator that crashed after recording intent). Same id and
        // time: the agent never carries it out twice, and a second write
        // while the watch lags is the same value, which the API server
        // leaves alone. Not in the seconds right after the request: the
        // watch may not show it yet (the e2e tests saw that, under load).
        let on_node = match action.type_ {
            RecoveryAction::GpuReset => node.reset_request.as_ref(),
            _ => node.reboot_request.as_ref(),
        };
        let requested_at = action.requested_at.as_ref().map_or(self.now(), |t| t.0);
        let settled = after(requested_at, REISSUE_AFTER) <= self.now();
        if on_node != Some(&action.id) && settled {
            match action.type_ {
                RecoveryAction::GpuReset => {
                    self.actions.push(Action::RequestReset {
                        id: action.id.clone(),
                        gpus: action.gpus.clone(),
                        requested_at,
                    });
                }
                _ => self.actions.push(Action::RequestReboot {
                    id: action.id.clone(),
                    requested_at,
                }),
            }
        } else if on_node != Some(&action.id) {
            self.wait(REISSUE_AFTER);
        }
        self.wait(POLL);
    }

    fn begin_verifying(&mut self, action: &ActionStatus) {
        self.record(Attempt::new(
            action.type_,
            action.attempt,
            AttemptOutcome::Succeeded,
        ));
        self.status.clear_since = None;
        self.enter(
            Phase::Verifying,
            Reason::Verifying,
            format!(
                "{:?} done; waiting for every signal to stay clear",
                action.type_
            ),
        );
        self.verifying();
    }

    fn verifying(&mut self) {
        let Some(action) = self.status.action.clone() else {
            return self.quarantined();
        };
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
            let since = self.status.clear_since.get_or_insert(Time(self.now())).0;
            let stable = after(since, verification.stable_for.as_std());
            if self.now() >= stable {
                return match &verification.validation_pod {
                    Some(pod) => self.validate(&action, stable, pod.timeout),
                    None => self.recovered(),
                };
            }
            let left = stable
                .duration_since(self.now())
                .try_into()
                .unwrap_or(Duration::ZERO);
            self.wait(left);
            return;
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
    }

    /// Signals have stayed clear: the validation pod must succeed too.
    fn validate(
        &mut self,
        action: &ActionStatus,
        since: Timestamp,
        timeout: gpuhealth_api::Duration,
    ) {
        let name = validation_pod_name(&self.input.node.name, &action.id);
        match self.input.validation {
            Some(pod) if pod.phase == "Succeeded" => {
                self.actions
                    .push(Action::DeleteValidationPod { name: name.clone() });
                self.record(
                    Attempt::new(
                        AttemptAction::ValidationPod,
                        action.attempt,
                        AttemptOutcome::Succeeded,
                    )
                    .saying(name.clone()),
                );
                self.recovered()
            }
            Some(pod) if pod.phase == "Failed" => {
                // Kept for its logs.
                self.record(
                    Attempt::new(
                        AttemptAction::ValidationPod,
                        action.attempt,
                        AttemptOutcome::Failed,
                    )
                    .saying(name.clone()),
                );
                self.escalate(format!(
                    "validation pod {name} failed: {}; it is kept for its logs (kubectl logs)",
                    pod.message
                ))
            }
            _ if self.now() >= after(since, timeout.as_std()) => {
                let seen = self.input.validation.is_some();
                self.actions
                    .push(Action::DeleteValidationPod { name: name.clone() });
                self.record(
                    Attempt::new(
                        AttemptAction::ValidationPod,
                        action.attempt,
                        AttemptOutcome::TimedOut,
                    )
                    .saying(name.clone()),
                );
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
        let message = if ours || !self.input.node.unschedulable {
            format!("incident {incident} recovered; node back in service")
        } else {
            format!(
                "incident {incident} recovered; the node stays cordoned: someone else cordoned it"
            )
        };
        self.close(IncidentOutcome::Recovered, message);
        self.start_workload_watch();
        self.status.maintenance = None;
        self.status.action = None;
        self.status.incident = None;
        self.status.clear_since = None;
        self.status.boot_id_before_reboot = None;
        self.back_in_service();
    }

    fn attempt_failed(&mut self, why: String) {
        if let Some(action) = &self.status.action {
            let failed = Attempt::new(action.type_, action.attempt, AttemptOutcome::Failed);
            self.record(failed);
        }
        self.escalate(why);
    }

    /// The attempt in flight failed (and is recorded): the next one, up the
    /// ladder when this rung's attempts are spent.
    fn escalate(&mut self, why: String) {
        let Some(action) = self.status.action.clone() else {
            return self.quarantined();
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

    fn exhausted(&mut self) {
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
    }

    fn fail(&mut self, reason: Reason, message: String) {
        self.close(IncidentOutcome::Failed, message.clone());
        self.enter(Phase::Failed, reason, message);
    }

    /// A person takes over from `Failed`: once they uncordon the node and
    /// its signals are clear, it is `Healthy` again.
    fn failed(&mut self) {
        if !self.input.node.unschedulable && self.diagnosis.is_clear() {
            self.status.action = None;
            self.status.incident = None;
            self.status.maintenance = None;
            self.back_in_service();
        }
    }

    /// Records a finding once (until it changes) and says so in an Event
    /// (about the node, or about the pod in `pod`).
    fn finding(&mut self, type_: FindingKind, subject: Option<String>, message: String) {
        self.finding_about(type_, subject, message, None);
    }

    fn finding_about(
        &mut self,
        type_: FindingKind,
        subject: Option<String>,
        message: String,
        pod: Option<String>,
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

    /// Remembers the controller of a pod about to be evicted: after the
    /// node recovers, what it runs must be serving again.
    fn note_evicted(&mut self, pod: &str) {
        let Some(workload) = self
            .input
            .pods
            .iter()
            .find(|p| p.key() == pod)
            .and_then(|p| p.workload.clone())
        else {
            return;
        };
        if let Some(incident) = self.status.history.first_mut() {
            let w = incident.workloads.get_or_insert_with(Default::default);
            if !w.evicted.contains(&workload) && w.evicted.len() < WORKLOADS_LIMIT {
                w.evicted.push(workload);
            }
        }
    }

    /// At uncordon: the evicted workloads have until the deadline to be
    /// Ready again.
    fn start_workload_watch(&mut self) {
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
    fn supersede_workload_watch(&mut self, new: &str) {
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
    fn watch_workloads(&mut self) {
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
                    Some(name.clone()),
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
                Some(format!("incident/{id}")),
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
    fn readiness_gates(&mut self) {
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

    /// Puts an attempt on the open incident's record, and says so.
    fn record(&mut self, attempt: Attempt) {
        if let Some(incident) = self.status.history.first_mut() {
            incident.attempts.push(attempt.clone());
            self.happenings.push(Happening::Attempted(attempt));
        }
    }

    /// Ends the open incident, and says so.
    fn close(&mut self, outcome: IncidentOutcome, message: String) {
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
}
