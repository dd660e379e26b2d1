//! Kills between an incident's fence and its status: the operator writes
//! the fence first (the cordon with the record naming the incident, or a
//! GPU's `DeviceTaintRule` labelled with it), then the status. Each trial
//! hands the Lease to a replica that exits right between the two (the
//! failpoint `Quarantined+fenced`), once where the fence is the node's
//! cordon and once, with the GPUs published as DRA devices, where it is
//! the GPU's rule. The standby must carry the incident on under the
//! fence's id: no cordon or rule orphaned (`NotSettled`,
//! `CordonOutlivedIncident`, `RuleOutlivedIncident`), none taken from a
//! person, no budget exceeded (`OverBudget`).

use std::time::Duration;

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{Fault, Rng, Row, fleet::Fleet, policy};
use crate::{Result, invariants::Violation, operator::Options};

/// Where the replica under trial exits.
const FAILPOINT: &str = "Quarantined+fenced";

pub async fn run(trials: usize, rng: &mut Rng) -> Result<Row> {
    let spec = policy(2, IntOrString::String("100%".into()));
    let mut fleet = Fleet::new("chaos-fence-kill", 4, spec, 1).await?;
    let mut row = Row::new("kill between fence and status");
    for _ in 0..trials {
        trial(&mut fleet, rng, &mut row).await?;
    }
    // The same, where the fence is the bad GPU's rule.
    fleet.s.publish_devices().await?;
    for _ in 0..trials {
        trial(&mut fleet, rng, &mut row).await?;
    }
    row.notes.push(format!(
        "each trial's leader exited at the failpoint {FAILPOINT}: {trials} with the node's cordon as the fence, {trials} with the GPU's DeviceTaintRule"
    ));
    fleet.add_notes(&mut row);
    Ok(row)
}

async fn trial(fleet: &mut Fleet, rng: &mut Rng, row: &mut Row) -> Result<()> {
    // The Lease to a replica that exits at the failpoint, a standby beside it.
    fleet.kill_all_but("").await;
    let options = Options {
        crash_after: Some(FAILPOINT.into()),
        ..fleet.s.operator_options.clone()
    };
    let crasher = fleet.start_replica_with(options).await?;
    let leader = fleet.live_leader().await?;
    if leader != crasher {
        return Err(crate::HarnessError::Invalid(format!(
            "{leader} leads, not the replica under trial {crasher}"
        )));
    }
    fleet.start_replica().await?;
    let (expect, violations) = fleet
        .trial(rng, 1, &[Fault::ResetHeals], async |fleet, _| {
            let ended = match fleet.remove(&crasher) {
                Some(mut replica) => replica
                    .exited(Duration::from_secs(120))
                    .await
                    .map(|e| e.code())
                    .map_err(|e| e.to_string()),
                None => Err("no longer in the fleet".into()),
            };
            Ok(match ended {
                Ok(Some(3)) => Vec::new(),
                other => vec![Violation::Missing {
                    what: format!("{crasher} exiting at {FAILPOINT} (it ended: {other:?})"),
                }],
            })
        })
        .await?;
    row.add_trial(&expect, violations);
    Ok(())
}
