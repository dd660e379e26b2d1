//! `Quarantined`: the node or its bad GPUs are fenced; the first attempt
//! is chosen from the ladder.

use std::time::Duration;

use gpuhealth_api::{RecoveryAction, node_health::Phase, vocabulary::Reason};

use crate::diagnosis::after;

use crate::machine::core::{Stepper, Then};

impl Stepper<'_> {
    pub(in crate::machine) fn quarantined(&mut self) -> Then {
        if !self.fenced() || self.held_by_other_actor(Phase::Quarantined) || self.cooling_down() {
            return Then::Done;
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
        self.start_attempt(rung, 1)
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
}
