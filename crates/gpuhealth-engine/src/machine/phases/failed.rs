//! `Failed`: whether a person has handed the node back.

use crate::machine::core::{Stepper, Then};

impl Stepper<'_> {
    /// A person takes over from `Failed`: once they uncordon the node and
    /// its signals are clear, it is `Healthy` again.
    pub(in crate::machine) fn failed(&mut self) -> Then {
        // A GPU fenced alone is handed back by mending it: the node serves.
        let per_gpu = self.status.quarantine.as_ref().is_some_and(|q| q.per_gpu());
        if (per_gpu || !self.input.node.unschedulable) && self.diagnosis.is_clear() {
            self.lift_quarantine();
            self.status.action = None;
            self.status.incident = None;
            self.status.maintenance = None;
            self.back_in_service();
        }
        Then::Done
    }
}
