//! API server and etcd restarts: each trial breaks up to three nodes, and
//! once one of them is draining or being reset, SIGKILLs the API server or
//! etcd (alternately) and starts it again. The operator's watches must
//! resume, and nothing may be repeated or lost.

use std::time::Duration;

use gpuhealth_api::node_health::Phase;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{Fault, Rng, Row, fleet::Fleet, policy};
use crate::{Result, cluster};

const COMPONENTS: [&str; 2] = ["kube-apiserver", "etcd"];
const PHASES: [Phase; 2] = [Phase::Draining, Phase::Remediating];

pub async fn run(trials: usize, rng: &mut Rng) -> Result<Row> {
    let mut spec = policy(2, IntOrString::String("100%".into()));
    // While the API server or etcd is down, KWOK (the kubelets here) backs
    // off as client-go's reflectors do (up to 30 s), so an evicted pod can
    // be deleted well after the restart: the usual 15 s drain timeout then
    // fails a drain that nothing blocks (seen on CI's slower machine).
    spec.drain.timeout = gpuhealth_api::Duration::from_secs(45);
    let mut fleet = Fleet::new("chaos-restart", 6, spec, 2).await?;
    let mut row = Row::new("API server / etcd restart");
    for trial in 1..=trials {
        let component = COMPONENTS[(trial - 1) % COMPONENTS.len()];
        let faulty = 1 + rng.below(3);
        let (expect, violations) = fleet
            .trial(rng, faulty, &Fault::ALL, async |fleet, rng| {
                let phase = PHASES[rng.below(PHASES.len())];
                fleet.reached(phase).await?;
                tokio::time::sleep(rng.within(Duration::from_secs(1))).await;
                cluster::restart(component).await?;
                Ok(Vec::new())
            })
            .await?;
        eprintln!("chaos: this trial restarted {component}");
        row.add_trial(&expect, violations);
    }
    fleet.add_notes(&mut row);
    Ok(row)
}
