//! A watch that lags behind after a takeover: the standby reaches the API
//! server through a proxy that answers its requests at once but delivers
//! what the server streams to it (its watches' events) `LAG` late. The
//! leader, on a direct connection, is SIGKILLed mid-remediation; the
//! standby leads with a view `LAG` old, in which the last writes of the
//! leader before it are missing. Every promise must hold: the new leader
//! confirms a remediation's start against a fresh list of statuses (a
//! request, answered at once) for its first minute.

use std::{collections::BTreeSet, time::Duration};

use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use super::{Fault, REMEDIATION_PHASES, Rng, Row, fencing::leads, fleet::Fleet, policy};
use crate::{Result, cluster, operator::Options, proxy::Proxy};

/// How late the standby's watches deliver: the chaos runs once saw a new
/// leader's view seven seconds old.
const LAG: Duration = Duration::from_secs(5);

pub async fn run(trials: usize, rng: &mut Rng) -> Result<Row> {
    let spec = policy(2, IntOrString::String("100%".into()));
    let mut fleet = Fleet::new("chaos-lag", 6, spec, 1).await?;
    fleet.s.publish_devices().await?;
    let proxy = Proxy::lagging(cluster::api_server_addr().await?, LAG).await?;
    let kubeconfig = std::env::temp_dir().join(format!("{}-via-proxy.kubeconfig", fleet.s.group));
    cluster::kubeconfig_via(proxy.addr, &kubeconfig).await?;
    let mut row = Row::new("watch lagging after a takeover");
    let mut lagging: BTreeSet<String> = BTreeSet::new();
    for _ in 0..trials {
        // A leader on a direct connection, and one lagging standby: a
        // lagging leader left by the last trial hands over to a direct one.
        let mut leader = fleet.live_leader().await?;
        fleet.kill_all_but(&leader).await;
        if lagging.contains(&leader) {
            let direct = fleet.start_replica().await?;
            if let Some(mut old) = fleet.remove(&leader) {
                old.kill().await;
            }
            leads(&fleet, &direct).await?;
            leader = direct;
        }
        let standby = fleet
            .start_replica_with(Options {
                kubeconfig: Some(kubeconfig.clone()),
                ..fleet.s.operator_options.clone()
            })
            .await?;
        lagging.insert(standby.clone());
        // One node more than maxConcurrent: a stale view endangers the
        // budget first.
        let (expect, violations) = fleet
            .trial(rng, 3, &Fault::ALL, async |fleet, rng| {
                fleet
                    .reached(REMEDIATION_PHASES[rng.below(REMEDIATION_PHASES.len())])
                    .await?;
                tokio::time::sleep(rng.within(Duration::from_secs(2))).await;
                if let Some(mut dead) = fleet.remove(&leader) {
                    dead.kill().await;
                    eprintln!("chaos: SIGKILLed the leader {leader}; {standby} lags {LAG:?}");
                }
                Ok(Vec::new())
            })
            .await?;
        row.add_trial(&expect, violations);
    }
    row.notes.push(format!(
        "the standby that took over saw the API server's streams {} s late, its requests answered at once",
        LAG.as_secs()
    ));
    fleet.add_notes(&mut row);
    Ok(row)
}
