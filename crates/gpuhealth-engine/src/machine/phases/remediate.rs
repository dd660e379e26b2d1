//! `Remediating`: the request is written, and its answer awaited.

use gpuhealth_api::{RecoveryAction, contract::Outcome};

use crate::diagnosis::after;

use crate::machine::{
    POLL, REISSUE_AFTER,
    core::{Stage, Stepper, Then},
};

impl Stepper<'_> {
    pub(in crate::machine) fn remediating(&mut self) -> Then {
        let Some(action) = self.status.action.clone() else {
            return Then::Run(Stage::Quarantined);
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
            (RecoveryAction::GpuReset, Some(_)) => return self.attempt_succeeded(&action),
            (RecoveryAction::NodeReboot, _)
                if self
                    .status
                    .boot_id_before_reboot
                    .as_deref()
                    .is_some_and(|b| b != node.boot_id) =>
            {
                return self.attempt_succeeded(&action);
            }
            _ => {}
        }
        if action.deadline.as_ref().is_some_and(|d| self.now() >= d.0) {
            return self.attempt_failed(format!(
                "{:?} attempt {} timed out",
                action.type_, action.attempt
            ));
        }
        let held = self.drain_newcomers(&action);
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
        // Never written again while a pod holds a GPU it covers.
        if on_node != Some(&action.id) && settled && !held {
            self.ask(&action, requested_at);
        } else if on_node != Some(&action.id) {
            self.wait(REISSUE_AFTER);
        }
        self.wait(POLL);
        Then::Done
    }
}
