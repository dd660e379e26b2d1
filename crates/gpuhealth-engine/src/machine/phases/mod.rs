//! One handler per phase. Each looks at the step so far and says what
//! comes next: done, or another phase's handler (`Then`).

mod diagnose;
mod draining;
mod failed;
mod healthy;
mod maintenance;
mod quarantined;
mod remediate;
mod verify;

use super::core::{Stage, Stepper, Then};

impl Stepper<'_> {
    /// Runs the handler of `stage`.
    pub(in crate::machine) fn run(&mut self, stage: Stage) -> Then {
        match stage {
            Stage::HealthyOrSuspect => self.healthy_or_suspect(),
            Stage::MaintenanceDrain => self.maintenance_drain(),
            Stage::Quarantined => self.quarantined(),
            Stage::Draining => self.draining(),
            Stage::AwaitingMaintenance => self.awaiting_maintenance(),
            Stage::Remediating => self.remediating(),
            Stage::Verifying => self.verifying(),
            Stage::Failed => self.failed(),
        }
    }
}
