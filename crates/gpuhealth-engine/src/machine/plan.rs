//! What a drain takes, and what a DryRun policy would do.

use gpuhealth_api::{RecoveryAction, node_health::Plan, policy::DrainScope, quarantine::Fenced};

use crate::drain::{self, DrainPlan};

use crate::machine::core::Stepper;

impl Stepper<'_> {
    pub(super) fn drain_scope(&self, action: RecoveryAction) -> DrainScope {
        // A reboot takes every pod down with the node.
        if action >= RecoveryAction::NodeReboot {
            DrainScope::AllPods
        } else {
            self.spec().drain.scope
        }
    }

    pub(super) fn drain_plan(&self, action: RecoveryAction, gpus: &[String]) -> DrainPlan {
        let mut scope = self.drain_scope(action);
        let unknown = self.holders_unknown(gpus);
        if scope == DrainScope::AffectedPods && unknown.is_some() {
            scope = DrainScope::GpuPods;
        }
        let never = &self.input.guardrails.never_drain;
        let mut plan = drain::plan(&self.spec().drain, never, scope, gpus, self.input.pods);
        if scope == DrainScope::GpuPods && self.spec().drain.scope == DrainScope::AffectedPods {
            plan.widened = unknown.map(|why| {
                format!("every GPU pod of the node is drained, not only the GPUs' holders: {why}")
            });
        }
        plan
    }

    /// Why the pods holding `gpus` (every GPU when none is named) are not
    /// known, if the report says they are not.
    pub(super) fn holders_unknown(&self, gpus: &[String]) -> Option<String> {
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

    pub(super) fn dry_run_plan(&self, required: RecoveryAction) -> Plan {
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
        let gangs = self.planned_gangs(&drain);
        let quarantine = self.planned_quarantine(Some(action.unwrap_or(required)));
        Plan {
            cordon: !self.input.node.unschedulable && quarantine.scope == Fenced::Node,
            quarantine: Some(quarantine),
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
            gangs,
        }
    }

    /// Whether a step takes down GPUs that are not broken: a reboot, or
    /// evicting a pod that holds no GPU the action is about.
    pub(super) fn disrupts_healthy_gpus(
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
}
