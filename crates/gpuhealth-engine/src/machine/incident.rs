//! Opening an incident, what it takes out of service, the repeat offenders it
//! hands over, and break glass.

use gpuhealth_api::{
    RecoveryAction,
    contract::RequestId,
    node_health::{HISTORY_LIMIT, Incident, OPENING_SIGNALS_LIMIT, OpeningSignal, Phase},
    policy::Mode,
    quarantine::Fenced,
    vocabulary::{Attempt, AttemptOutcome, FindingKind, IncidentOutcome, Reason},
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::happening::Happening;

use crate::machine::{Action, core::Stepper};

/// What an incident took out of service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Taken {
    /// gpuhealth cordoned the node, and lifts the cordon at recovery.
    Cordoned,
    /// Someone else had cordoned it: gpuhealth keeps it and never lifts it.
    KeptCordon,
    /// Only the bad GPUs, as said; the node takes new work.
    Gpus(String),
}

impl Taken {
    /// How a message begins: `cordoned for: …`.
    pub(super) fn done(&self) -> String {
        match self {
            Taken::Cordoned => "cordoned".into(),
            Taken::KeptCordon => {
                "kept the cordon someone else made (it stays after recovery)".into()
            }
            Taken::Gpus(fenced) => fenced.clone(),
        }
    }
}

impl Stepper<'_> {
    /// Starts an incident: recorded first, then its quarantine. That is
    /// the bad GPUs alone where a fence holds for each and `step` (None: a
    /// maintenance) needs nothing node-wide; else the cordon (unless the
    /// node is cordoned already by anyone else; a cordon of ours left from
    /// the last incident is taken over by this one). What it took: someone
    /// else's cordon is kept, not made, and stays after recovery.
    pub(super) fn open_incident(
        &mut self,
        trigger: String,
        gpus: Vec<String>,
        maintenance_deadline: Option<Time>,
        step: Option<RecoveryAction>,
    ) -> Taken {
        let leftover = self.leftover_cordon();
        let adopted = self.unrecorded_fence();
        let incident = adopted.clone().unwrap_or_else(|| self.new_incident_id());
        let node = self.input.node;
        let cordon_adopted = adopted.is_some() && node.unschedulable && node.cordoned_by == adopted;
        let choice = self.choose_quarantine(&incident, &gpus, step);
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
                signals: self.opening_signals(),
                attempts: Vec::new(),
                actions: Vec::new(),
                outcome: None,
                gpus,
                maintenance_deadline,
                workloads: None,
                gangs: Vec::new(),
            },
        );
        self.status.history.truncate(HISTORY_LIMIT);
        let scope = choice.scope;
        let fenced = choice.message.clone();
        self.record_quarantine(&incident, choice);
        let taken = match scope {
            Fenced::Gpu => Taken::Gpus(fenced),
            Fenced::Node if cordon_adopted => Taken::Cordoned,
            Fenced::Node if self.input.node.unschedulable && leftover.is_none() => {
                return Taken::KeptCordon;
            }
            Fenced::Node => {
                self.actions.push(Action::Cordon { incident });
                Taken::Cordoned
            }
        };
        // Only a report that shows the fault dates it: a quarantine for a
        // node condition or a maintenance notice says nothing of reaction time.
        if let Some(Ok(report)) = &self.input.node.report
            && report.bad_gpus().next().is_some()
        {
            let observed_at = report.observed_at.0;
            self.tell(Happening::QuarantinedForReport { observed_at });
        }
        taken
    }

    fn opening_signals(&self) -> Vec<OpeningSignal> {
        self.diagnosis
            .signals
            .iter()
            .take(OPENING_SIGNALS_LIMIT)
            .map(|s| OpeningSignal {
                reason: s.reason,
                gpu: s.gpu.clone(),
                xid: s.xid.clone(),
                message: s.message.clone(),
            })
            .collect()
    }

    /// Unique across the fleet (the node is in it) and within the node's
    /// history (a second incident in the same second is numbered).
    fn new_incident_id(&self) -> String {
        let base = RequestId::for_incident(&self.input.node.name, self.now().as_second());
        let taken = |id: &str| self.status.history.iter().any(|i| i.id == id);
        let mut id = base.to_string();
        let mut n = 2;
        while taken(&id) {
            id = format!("{base}-{n}");
            n += 1;
        }
        id
    }

    /// Whether a fence's record naming an incident is taken as ours to
    /// carry on or lift: only under Enforce (nothing else writes fences),
    /// and only while the admission protection is in force. Without it,
    /// whoever may patch a Node could have written the record, and a cordon
    /// of theirs would be taken, or lifted, as ours.
    fn trusts_fence_records(&self) -> bool {
        self.spec().mode == Mode::Enforce && self.input.not_enforced.is_none()
    }

    /// Our cordon from an incident that ended with the node back in service
    /// (its record still on the node, no incident open): the uncordon was
    /// decided and recorded but did not land (refused as a conflict, or the
    /// operator stopped between the two). The incident's id, if so; only
    /// where the record is trusted (see [`Stepper::trusts_fence_records`]):
    /// an incident's id is in its status for anyone to copy onto a cordon of
    /// theirs, which would then be lifted as ours.
    pub(super) fn leftover_cordon(&self) -> Option<String> {
        if !self.trusts_fence_records() {
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

    /// A fence of ours naming an incident this status has never held: the
    /// operator writes an incident's fence (the cordon with its record, or
    /// a GPU's `DeviceTaintRule`, labelled with the incident) before its
    /// status, and one stopped between the two left the fence as the only
    /// record of it. That incident is the one to carry on, under its id;
    /// anyone else's cordon carries no record of ours (only the operator may
    /// write one), and an incident already in the history is not reopened.
    /// Only where the record is trusted (see
    /// [`Stepper::trusts_fence_records`]).
    pub(super) fn unrecorded_fence(&self) -> Option<String> {
        if !self.trusts_fence_records() || self.status.incident.is_some() {
            return None;
        }
        let node = self.input.node;
        let cordon = node.cordoned_by.as_ref().filter(|_| node.unschedulable);
        let rules = node
            .dra
            .iter()
            .flat_map(|d| d.rules.iter().map(|r| &r.incident));
        let known = |id: &String| self.status.history.iter().any(|i| &i.id == id);
        cordon
            .into_iter()
            .chain(rules)
            .find(|id| !known(id))
            .cloned()
    }

    /// Our cordon with the record of an incident never recorded (see
    /// [`Stepper::unrecorded_fence`]), on a node with nothing to act on now.
    pub(super) fn unrecorded_cordon(&self) -> Option<String> {
        let node = self.input.node;
        self.unrecorded_fence()
            .filter(|id| node.unschedulable && node.cordoned_by.as_ref() == Some(id))
    }

    /// A record of ours on a node that is not cordoned, naming an incident
    /// that is not the open one: someone uncordoned the node by hand (a
    /// handed-over node repaired, say). It is forgotten, unless this step
    /// cordons, whose write carries the record of its own. Only under
    /// Enforce, like every write to the node.
    pub(super) fn forget_stale_cordon_record(&mut self) {
        let node = self.input.node;
        let Some(record) = node.cordoned_by.as_ref() else {
            return;
        };
        let cordons = self
            .actions
            .iter()
            .any(|a| matches!(a, Action::Cordon { .. }));
        if self.spec().mode == Mode::Enforce
            && !node.unschedulable
            && self.status.incident.as_ref() != Some(record)
            && !cordons
        {
            self.actions.push(Action::ForgetCordonRecord {
                incident: record.clone(),
            });
        }
    }

    /// Whether this GPU or node was remediated as often as the policy
    /// allows in its window; why, if so.
    pub(super) fn repeat_offender(&self, gpus: &[String]) -> Option<String> {
        let limits = &self.spec().remediation_limits;
        let since = self
            .now()
            .checked_sub(k8s_openapi::jiff::SignedDuration::try_from(limits.window.as_std()).ok()?)
            .ok()?;
        // Remediations that acted: not maintenance, not a hand-over, not
        // one application Xids alone opened (a tenant's code may be behind
        // those, and must not cost the fleet a node).
        let recent: Vec<&Incident> = self
            .status
            .history
            .iter()
            .filter(|i| i.started_at.0 >= since && !i.attempts.is_empty())
            .filter(|i| i.maintenance_deadline.is_none())
            .filter(|i| !i.opened_by_app_faults_alone())
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

    /// An administrator cleared a request or gpuhealth's cordon record by
    /// hand (admission lets them only with a reason): a request in flight is
    /// abandoned, never re-issued, and the node is left to them, cordoned,
    /// as after any failure. Their reason is a finding (an Event, and
    /// `gpuhealth_findings_total{type="BreakGlass"}`) either way.
    pub(super) fn break_glass(&mut self, reason: &str) {
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
}
