//! A provider's scheduled maintenance: due, drained for, awaited, or
//! withdrawn.

use gpuhealth_api::vocabulary::FindingSubject;
use std::time::Duration;

use gpuhealth_api::{
    RecoveryAction,
    contract::RequestId,
    node_health::{ActionStatus, Phase},
    policy::DrainScope,
    vocabulary::{Attempt, AttemptAction, AttemptOutcome, FindingKind, IncidentOutcome, Reason},
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::{
    diagnosis::after,
    drain::{self},
};

use crate::machine::{
    Action, POLL,
    core::{Stage, Stepper, Then},
    whole_second,
};

impl Stepper<'_> {
    /// Quarantined or draining ahead of a scheduled maintenance: every pod
    /// leaves (the provider takes the whole node), by the same rules.
    pub(in crate::machine) fn maintenance_drain(&mut self) -> Then {
        if self.maintenance_withdrawn() {
            self.maintenance_cancelled();
            return Then::Done;
        }
        let phase = self.status.phase;
        if !self.cordoned() || self.held_by_other_actor(phase) {
            return Then::Done;
        }
        let plan = drain::plan(
            &self.spec().drain,
            &self.input.guardrails.never_drain,
            DrainScope::AllPods,
            &[],
            self.input.pods,
        );
        if !plan.is_done() {
            self.drain(plan, Reason::DrainingForMaintenance);
            return Then::Done;
        }
        let now = self.now();
        let Some(m) = self.status.maintenance.as_mut() else {
            return Then::Run(Stage::Quarantined);
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
        Then::Done
    }

    /// Drained and waiting: the provider's work shows as a new boot id.
    pub(in crate::machine) fn awaiting_maintenance(&mut self) -> Then {
        let Some(m) = self.status.maintenance.clone() else {
            return Then::Run(Stage::Quarantined);
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
            return Then::Run(Stage::Verifying);
        }
        if self.maintenance_withdrawn() {
            self.maintenance_cancelled();
            return Then::Done;
        }
        let overdue = after(m.deadline.0, self.spec().maintenance.overdue_after.as_std());
        if self.now() >= overdue {
            let message = format!(
                "drained for {}'s maintenance due {}, but the node has not been taken down (same boot id) by {overdue}; it stays cordoned: ask the provider, or remove the gpuhealth.io/maintenance annotation to return it to service",
                m.source, m.deadline.0
            );
            self.finding(
                FindingKind::MaintenanceOverdue,
                Some(FindingSubject::Named(m.source.clone())),
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
        Then::Done
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
}
