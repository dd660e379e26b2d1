//! Upgrade mid-remediation: the fleet's replicas run the previous release
//! (`make previous-release`: the commit before this one, built from git).
//! Each trial breaks nodes and, once one of them is in the trial's phase
//! (each phase in turn: Quarantined, Draining, Remediating, Verifying),
//! replaces the agents by this build as a DaemonSet's rolling update would
//! (the old one stopped mid-request, perhaps; the new one reads its
//! journal), then the replicas as a Deployment's would. Nothing may be
//! lost, repeated or left cordoned: the same invariants as every trial.
//! Between trials, with every node settled, the fleet rolls back to the
//! previous release for the next one.

use std::{path::Path, time::Duration};

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{Fault, REMEDIATION_PHASES, Rng, Row, fleet::Fleet, policy};
use crate::{Result, operator::Options};

pub async fn run(trials: usize, previous: &Path, rng: &mut Rng) -> Result<Row> {
    let mut row = Row::new("upgrade mid-remediation");
    if !previous.exists() {
        // A clone without the commit before HEAD (a shallow one) has no
        // previous release to build: said in the table, not passed over.
        row.notes.push(format!(
            "not run: no previous release at {} (make previous-release builds it from the commit before HEAD, which this clone lacks)",
            previous.display()
        ));
        return Ok(row);
    }
    let spec = policy(2, IntOrString::String("100%".into()));
    let options = Options {
        binary: Some(previous.to_path_buf()),
        ..Default::default()
    };
    let mut fleet = Fleet::with_options("chaos-upgrade", 6, spec, 2, options).await?;
    fleet.s.publish_devices().await?;
    // The previous release's agent, built beside its operator; one built
    // before the agent was upgraded too has none.
    let previous_agent = previous.with_file_name("gpuhealth-agent");
    let previous_agent = previous_agent.exists().then_some(previous_agent);
    fleet.s.roll_agents_to(previous_agent.as_deref()).await?;
    for trial in 0..trials {
        let phase = REMEDIATION_PHASES[trial % REMEDIATION_PHASES.len()];
        let faulty = 1 + rng.below(3);
        let (expect, violations) = fleet
            .trial(rng, faulty, &Fault::ALL, async |fleet, rng| {
                fleet.reached(phase).await?;
                tokio::time::sleep(rng.within(Duration::from_secs(2))).await;
                fleet.s.roll_agents_to(None).await?;
                fleet.roll_to(None).await?;
                eprintln!("chaos: upgraded the agents and replicas to this build in {phase:?}");
                Ok(Vec::new())
            })
            .await?;
        row.add_trial(&expect, violations);
        fleet.s.roll_agents_to(previous_agent.as_deref()).await?;
        fleet.roll_to(Some(previous.to_path_buf())).await?;
    }
    row.notes.push(format!(
        "from {} (and {}) to this build, once per trial, each phase in turn",
        previous.display(),
        previous_agent.as_ref().map_or_else(
            || "this build's agent: the previous release has none built".to_owned(),
            |a| a.display().to_string()
        )
    ));
    fleet.add_notes(&mut row);
    Ok(row)
}
