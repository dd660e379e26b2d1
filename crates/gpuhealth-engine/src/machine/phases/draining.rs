//! `Draining`: the attempt's pods leave, a round at a time.

use std::time::Duration;

use gpuhealth_api::{
    node_health::{ActionStatus, Phase},
    vocabulary::Reason,
};

use crate::windows;

use crate::machine::{
    Action, DRAIN_POLL, FENCE_SETTLE, POLL,
    core::{Stage, Stepper, Then},
    ladder::{requested, verifying},
    validation_pod_name,
};

impl Stepper<'_> {
    pub(in crate::machine) fn draining(&mut self) -> Then {
        let Some(action) = self.status.action.clone() else {
            // Draining with no attempt recorded: decide one afresh.
            return Then::Run(Stage::Quarantined);
        };
        if self.widened_and_not_cordoned() || self.held_by_other_actor(Phase::Draining) {
            return Then::Done;
        }
        let mut plan = self.drain_plan(action.type_, &action.gpus);
        self.gang_rounds(&mut plan, &action);
        if self.disrupts_healthy_gpus(action.type_, &action.gpus, &plan)
            && let Some(why) = self.outside_window()
        {
            // Cordoned, nothing evicted yet: the drain's timeout starts
            // when the drain does.
            self.enter(Phase::Quarantined, Reason::OutsideMaintenanceWindow, why);
            return Then::Done;
        }
        if plan.is_done() {
            if let Some((left, since)) = self.fence_settling() {
                let message = format!(
                    "{:?} {} waits until the GPUs' DeviceTaintRules, up since {since}, have stood {} s: a scheduler that had not seen them may still allocate the devices until then, and such a pod is drained first",
                    action.type_,
                    action.id,
                    FENCE_SETTLE.as_secs()
                );
                self.enter(Phase::Draining, Reason::Draining, message);
                self.wait(left);
                return Then::Done;
            }
            return self.request(action);
        }
        self.drain(plan, Reason::Draining);
        Then::Done
    }

    /// Holders are a watched set, not a snapshot: a pod that has come to
    /// hold a GPU `action` covers since its drain finished (a claim
    /// allocated before the fence was up, or while a rule someone deleted
    /// was written again) is drained under the same rules, and the status
    /// names it. Whether one still holds such a GPU.
    pub(in crate::machine) fn drain_newcomers(&mut self, action: &ActionStatus) -> bool {
        let mut plan = self.drain_plan(action.type_, &action.gpus);
        // The attempt's own validation pod holds the GPU on purpose.
        plan.pass_over(&validation_pod_name(&self.input.node.name, &action.id));
        if plan.is_done() {
            if self.status.reason == Some(Reason::HolderArrived) {
                let (phase, reason, message) = self.resumed(action);
                self.enter(phase, reason, message);
            }
            return false;
        }
        for pod in &plan.evict {
            self.note_evicted(pod);
            self.actions.push(Action::Evict { pod: pod.clone() });
        }
        let holders: Vec<String> = plan
            .evict
            .iter()
            .map(|p| format!("{p} (evicted)"))
            .chain(plan.waiting.iter().map(|p| format!("{p} (leaving)")))
            .chain(plan.blocked.iter().map(|(p, why)| format!("{p} ({why})")))
            .collect();
        let phase = self.status.phase;
        self.enter(
            phase,
            Reason::HolderArrived,
            format!(
                "{:?} {} waits: pods came to hold its GPUs after the drain: {}",
                action.type_,
                action.id,
                holders.join(", ")
            ),
        );
        self.wait(DRAIN_POLL);
        true
    }

    /// What the status said before a newcomer held up `action`.
    fn resumed(&self, action: &ActionStatus) -> (Phase, Reason, String) {
        match self.status.phase {
            Phase::Verifying => (Phase::Verifying, Reason::Verifying, verifying(action)),
            phase => (phase, Reason::ActionRequested, requested(action)),
        }
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
}
