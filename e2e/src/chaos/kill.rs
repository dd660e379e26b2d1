//! Operator kills: each trial breaks up to three nodes with random faults,
//! then SIGKILLs the leader at a random moment of their remediation (up to
//! two seconds after one of them enters a random phase); the standby takes
//! over, and a replacement replica starts, as a Deployment would start one.
//! The nodes' GPUs are DRA devices too, so that a reset's incident fences
//! the GPU alone with a `DeviceTaintRule` and a kill lands around writing
//! or deleting one (the checker: `Unfenced`, `RuleOutlivedIncident`).

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{Fault, REMEDIATION_PHASES, Rng, Row, fleet::Fleet, policy};
use crate::Result;

pub async fn run(trials: usize, rng: &mut Rng) -> Result<Row> {
    let spec = policy(2, IntOrString::String("100%".into()));
    let mut fleet = Fleet::new("chaos-kill", 6, spec, 2).await?;
    fleet.s.publish_devices().await?;
    let mut row = Row::new("operator SIGKILL");
    for _ in 0..trials {
        let faulty = 1 + rng.below(3);
        let (expect, violations) = fleet
            .trial(rng, faulty, &Fault::ALL, async |fleet, rng| {
                let phase = REMEDIATION_PHASES[rng.below(REMEDIATION_PHASES.len())];
                fleet.reached(phase).await?;
                tokio::time::sleep(rng.within(Duration::from_secs(2))).await;
                fleet.kill_leader().await?;
                Ok(Vec::new())
            })
            .await?;
        row.add_trial(&expect, violations);
    }
    fleet.add_notes(&mut row);
    Ok(row)
}
