//! One round of a drain: evict what may go, wait for the rest, and fail or
//! force at the drain's timeout.

use gpuhealth_api::{
    node_health::{Phase, WORKLOADS_LIMIT},
    policy::DrainTimeoutAction,
    vocabulary::{PodKey, Reason},
};

use crate::drain::{BudgetView, DrainPlan};

use crate::machine::{Action, DRAIN_POLL, core::Stepper};

impl Stepper<'_> {
    /// One round of a drain that is not done: evict what may go, wait for
    /// the rest, and fail or force at `drain.timeout`.
    pub(super) fn drain(&mut self, plan: DrainPlan, reason: Reason) {
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
                .map(ToString::to_string)
                .chain(
                    plan.with_gang
                        .iter()
                        .map(|p| format!("{p} (with its gang)")),
                )
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
        // The budget view a DryRun plan shows, for the pods to evict now.
        let budgets = self.input.disruption_budgets.iter();
        let (budgets_at_zero, other_budgets): (Vec<_>, Vec<_>) =
            budgets.partition(|b| b.allowed <= 0);
        let say = |bs: Vec<&BudgetView>| -> Vec<String> {
            bs.into_iter()
                .filter_map(|b| b.against(&plan.evict))
                .collect()
        };
        let (mut budgets_at_zero, other_budgets) = (say(budgets_at_zero), say(other_budgets));
        budgets_at_zero.extend(plan.gang_budgets.iter().cloned());
        match plan.blocked.first() {
            Some((pod, why)) => {
                let message = format!("waiting for pod {pod} to leave: {why}");
                self.enter(Phase::Draining, Reason::WaitingForPod, message);
            }
            None if !budgets_at_zero.is_empty() => {
                let mut message = format!(
                    "waiting for PodDisruptionBudget {}; {} to evict, {} to finish",
                    budgets_at_zero.join("; "),
                    plan.evict.len(),
                    plan.waiting.len()
                );
                for gang in &plan.gangs {
                    message.push_str(&format!("; {gang}"));
                }
                self.enter(Phase::Draining, Reason::WaitingForDisruptionBudget, message);
            }
            None => {
                let mut message = format!(
                    "{} to evict, {} to finish",
                    plan.evict.len(),
                    plan.waiting.len()
                );
                if !plan.with_gang.is_empty() {
                    message.push_str(&format!(", {} with their gang", plan.with_gang.len()));
                }
                for gang in &plan.gangs {
                    message.push_str(&format!("; {gang}"));
                }
                if let Some(why) = &plan.widened {
                    message.push_str(&format!("; {why}"));
                }
                if !other_budgets.is_empty() {
                    message.push_str(&format!("; budgets: {}", other_budgets.join("; ")));
                }
                self.enter(Phase::Draining, reason, message);
            }
        }
        self.wait(DRAIN_POLL);
    }

    /// Remembers the controller of a pod about to be evicted: after the
    /// node recovers, what it runs must be serving again.
    pub(super) fn note_evicted(&mut self, pod: &PodKey) {
        let Some(workload) = self
            .input
            .pods
            .iter()
            .find(|p| &p.key() == pod)
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
}
