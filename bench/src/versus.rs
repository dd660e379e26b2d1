//! gpuhealth beside the peer (Medik8s Node Healthcheck) at one fleet size:
//! the same signal (`BenchGpuHealthy=False` written on a node), the same API
//! server, faults alternating between the nodes left to each. For each, the
//! time from the condition seen on a watch to its first action seen
//! (gpuhealth's cordon on the same watch; the peer's remediation object on
//! a watch of its own), then what each costs at rest and in a storm.

use std::{
    collections::{BTreeMap, HashMap},
    time::{Duration, Instant},
};

use futures::future::{join_all, try_join_all};
use gpuhealth_api::{
    GpuHealthPolicy, GpuNodeHealth, node_health::Phase, quarantine::QuarantineScope,
};
use gpuhealth_e2e::{process::Process, sim::is_cordoned};
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api, Client,
    api::{Patch, PatchParams},
};
use serde_json::json;
use tokio::task::JoinHandle;

use crate::{
    Args, Result, fleet,
    fleet::GROUP,
    peer::{Nhc, Remediations, Running, SIDE_LABEL, Side},
    results::{Cost, PeerSize, Reaction, StormCost},
    say,
    stats::{self, Distribution, WRITES},
    watch::{self, CONDITION, Cordons},
};

const OPERATOR_REQUESTS: &str = "gpuhealth_api_requests_total";
/// controller-runtime's client counter: by HTTP method and code only.
const PEER_REQUESTS: &str = "rest_client_requests_total";
const PEER_WRITES: [&str; 4] = ["POST", "PUT", "PATCH", "DELETE"];
/// How long each side may take at `nodes` nodes: its first action (after
/// that the fault counts as missed) and the node's return to itself (after
/// that the run fails). The peer reads every healthy node's Lease once a
/// pass at its client's 20 requests a second (bench/FINDINGS.md), so its
/// pass grows with the fleet: a first action is given two passes.
#[derive(Clone, Copy)]
struct Patience {
    first_action: Duration,
    restored: Duration,
}

impl Patience {
    fn at(nodes: usize) -> Patience {
        let pass = Duration::from_millis(nodes as u64 * 50);
        Patience {
            first_action: Duration::from_secs(120).max(pass * 2),
            restored: Duration::from_secs(300).max(pass * 3),
        }
    }
}

/// What one comparison needs of the run.
pub struct Bench<'a> {
    pub args: &'a Args,
    pub client: &'a Client,
    pub cordons: &'a Cordons,
    pub operator: &'a Process,
    pub operator_pid: u32,
    pub nhc: &'a Nhc,
}

/// The nodes left to each tool: every fault of a side lands on one of its
/// nodes, in turn, once the node is itself again.
pub struct Sides {
    pub gpuhealth: Vec<String>,
    pub nhc: Vec<String>,
}

impl Sides {
    /// `k` nodes each from `pool`, alternately.
    pub fn from(pool: &[String], k: usize) -> Sides {
        let (gpuhealth, nhc) = pool
            .chunks_exact(2)
            .take(k)
            .map(|p| (p[0].clone(), p[1].clone()))
            .unzip();
        Sides { gpuhealth, nhc }
    }

    fn of(&self, side: Side) -> &[String] {
        match side {
            Side::Gpuhealth => &self.gpuhealth,
            Side::Nhc => &self.nhc,
        }
    }
}

/// One comparison with `nodes` in the fleet.
pub async fn at_size(b: &Bench<'_>, nodes: usize, sides: &Sides) -> Result<PeerSize> {
    say(&format!(
        "beside the peer at {nodes} nodes: {} faults each, {} nodes each",
        b.args.peer_faults,
        sides.gpuhealth.len()
    ));
    // Both with no limit but their own speed: every sick node at once (the
    // peer's `minHealthy: 0`), and no reset limits on nodes that fail in turn.
    Api::<GpuHealthPolicy>::all(b.client.clone())
        .patch(
            GROUP,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {
                "maxConcurrent": "100%",
                "quarantine": {"scope": QuarantineScope::Auto},
                "remediationLimits": {"perGpu": 0, "perNode": 0},
            }})),
        )
        .await?;
    for side in [Side::Gpuhealth, Side::Nhc] {
        fleet::label(b.client, sides.of(side), SIDE_LABEL, Some(side.label())).await?;
    }
    let remediations = Remediations::default();
    let _watch = remediations.watch(b.client);
    let peer = b.nhc.start(b.client, nodes - sides.gpuhealth.len()).await?;
    let pids = Pids {
        operator: b.operator_pid,
        peer: peer.pid,
    };
    let ends = Ends {
        cordons: b.cordons.clone(),
        remediations: remediations.clone(),
        patience: Patience::at(nodes),
    };
    let rest = at_rest(b, &peer, pids).await?;
    let reactions = one_at_a_time(b, &ends, sides).await?;
    let mut storms = Vec::new();
    for side in [Side::Gpuhealth, Side::Nhc] {
        let nodes = &sides.of(side)[..b.args.peer_storm.min(sides.of(side).len())];
        storms.push(storm(b, &peer, pids, &ends, side, nodes).await?);
    }
    let peer_log = peer.process.log.clone();
    peer.stop(b.client).await?;
    for side in [Side::Gpuhealth, Side::Nhc] {
        fleet::label(b.client, sides.of(side), SIDE_LABEL, None).await?;
    }
    let reaction = |side: Side, i: usize| {
        let (taken, missed): (Vec<_>, Vec<_>) = reactions
            .iter()
            .filter(|(s, _)| *s == side)
            .map(|(_, r)| *r)
            .partition(Option::is_some);
        let seconds: Vec<f64> = taken.into_iter().flatten().collect();
        Reaction {
            first_action: Distribution::of(seconds.clone()),
            seconds,
            missed: missed.len(),
            rest: rest[i].clone(),
            storm: storms[i].clone(),
        }
    };
    let (gpuhealth, nhc) = (reaction(Side::Gpuhealth, 0), reaction(Side::Nhc, 1));
    // A comparison is only read from faults both reacted to: gpuhealth
    // misses none (as in the time to quarantine), and a peer that acted on
    // none is a peer whose setup is broken, not a slow one.
    if gpuhealth.missed > 0 {
        return Err(format!("gpuhealth missed {} of its faults", gpuhealth.missed).into());
    }
    if nhc.first_action.n == 0 {
        return Err(format!(
            "the peer acted on none of its faults: see {}",
            peer_log.display()
        )
        .into());
    }
    say(&format!(
        "at {nodes} nodes, first action p50 / p99: gpuhealth {:.3} / {:.3} s, peer {:.3} / {:.3} s",
        gpuhealth.first_action.p50,
        gpuhealth.first_action.p99,
        nhc.first_action.p50,
        nhc.first_action.p99
    ));
    Ok(PeerSize {
        nodes,
        ratio_p50: gpuhealth.first_action.p50 / nhc.first_action.p50,
        ratio_p99: gpuhealth.first_action.p99 / nhc.first_action.p99,
        gpuhealth,
        nhc,
    })
}

#[derive(Clone, Copy)]
struct Pids {
    operator: u32,
    peer: u32,
}

impl Pids {
    fn of(self, side: Side) -> u32 {
        match side {
            Side::Gpuhealth => self.operator,
            Side::Nhc => self.peer,
        }
    }
}

/// Where each fault's two ends are seen: the condition turning `False` on
/// the bench's watch of the nodes, and the tool's first action after it.
#[derive(Clone)]
struct Ends {
    cordons: Cordons,
    remediations: Remediations,
    patience: Patience,
}

/// When a node's condition was seen `False`, and when the first action.
type Seen = (Instant, Instant);

impl Ends {
    fn reaction(&self, side: Side, node: &str, since: Instant) -> Option<Seen> {
        let seen = self.cordons.condition_false(node, since)?;
        let acted = match side {
            Side::Gpuhealth => self.cordons.after(node, seen),
            Side::Nhc => self.remediations.after(node, seen),
        }?;
        Some((seen, acted))
    }

    /// The reaction to a fault written at `since`, once seen; none if no
    /// first action came within its patience.
    async fn awaited(&self, side: Side, node: &str, since: Instant) -> Option<Seen> {
        watch::awaited(since + self.patience.first_action, || {
            self.reaction(side, node, since)
        })
        .await
    }
}

/// Each one's requests so far, by (verb or method, resource or code).
async fn requests(
    b: &Bench<'_>,
    peer: &Running,
    side: Side,
) -> Result<BTreeMap<(String, String), f64>> {
    Ok(match side {
        Side::Gpuhealth => stats::requests(&b.operator.scrape().await?, OPERATOR_REQUESTS),
        Side::Nhc => stats::counted_by(&peer.scrape().await?, PEER_REQUESTS, ["method", "code"]),
    })
}

/// Requests and writes between two scrapes (gpuhealth's leader Lease
/// renewals apart: the peer runs without leader election).
fn requests_and_writes(
    side: Side,
    before: &BTreeMap<(String, String), f64>,
    after: &BTreeMap<(String, String), f64>,
) -> (f64, f64) {
    let all = stats::delta(before, after, |_, resource| resource != "leases");
    let writes = all
        .iter()
        .filter(|((verb, _), _)| match side {
            Side::Gpuhealth => WRITES.contains(&verb.as_str()),
            Side::Nhc => PEER_WRITES.contains(&verb.as_str()),
        })
        .map(|(_, n)| n)
        .sum::<f64>();
    (all.values().sum::<f64>() + 0.0, writes + 0.0)
}

/// Nothing fails for `--peer-rest-secs`: each one's memory, requests and CPU.
async fn at_rest(b: &Bench<'_>, peer: &Running, pids: Pids) -> Result<[Cost; 2]> {
    let sides = [Side::Gpuhealth, Side::Nhc];
    let mut before = Vec::new();
    for side in sides {
        let cpu = stats::cpu_seconds(pids.of(side)).ok_or("a process exited")?;
        before.push((requests(b, peer, side).await?, cpu));
    }
    tokio::time::sleep(Duration::from_secs(b.args.peer_rest_secs)).await;
    let minutes = b.args.peer_rest_secs as f64 / 60.0;
    let mut costs = Vec::new();
    for (side, (requests_before, cpu_before)) in sides.into_iter().zip(before) {
        let pid = pids.of(side);
        let after = requests(b, peer, side).await?;
        let (all, writes) = requests_and_writes(side, &requests_before, &after);
        let (rss, _) = stats::memory_kib(pid).ok_or("a process exited")?;
        costs.push(Cost {
            rss_mib: rss as f64 / 1024.0,
            requests_per_minute: all / minutes,
            writes_per_minute: writes / minutes,
            cpu_seconds_per_minute: (stats::cpu_seconds(pid).ok_or("a process exited")?
                - cpu_before)
                / minutes,
        });
    }
    let [gpuhealth, nhc]: [Cost; 2] = costs.try_into().map_err(|_| "two costs")?;
    Ok([gpuhealth, nhc])
}

/// `--peer-faults` faults on each side, alternating, one every
/// `--peer-interval-ms`; a node takes its next fault once it is itself
/// again. Returns each fault's seconds to the first action (none: missed).
async fn one_at_a_time(
    b: &Bench<'_>,
    ends: &Ends,
    sides: &Sides,
) -> Result<Vec<(Side, Option<f64>)>> {
    type Fault = JoinHandle<Result<(Side, Option<f64>)>>;
    let mut in_flight: HashMap<String, Fault> = HashMap::new();
    let mut samples = Vec::new();
    for i in 0..b.args.peer_faults {
        for side in [Side::Gpuhealth, Side::Nhc] {
            let nodes = sides.of(side);
            let node = nodes[i % nodes.len()].clone();
            if let Some(fault) = in_flight.remove(&node) {
                samples.push(fault.await??);
            }
            let written = Instant::now();
            set_condition(b.client, &node, false).await?;
            // Seen, then restored, in a task of its own, so that faults
            // keep arriving at their pace.
            let (client, ends, this) = (b.client.clone(), ends.clone(), node.clone());
            let fault = tokio::spawn(async move {
                let seen = ends.awaited(side, &this, written).await;
                restore(&client, side, &this, &ends).await?;
                let seconds = seen.map(|(seen, acted)| acted.duration_since(seen).as_secs_f64());
                Ok((side, seconds))
            });
            in_flight.insert(node, fault);
            tokio::time::sleep(Duration::from_millis(b.args.peer_interval_ms)).await;
        }
    }
    for fault in in_flight.into_values() {
        samples.push(fault.await??);
    }
    Ok(samples)
}

/// The condition healthy again, and the node back as it was: gpuhealth's
/// remediation ended (`Healthy`, uncordoned), the peer's object deleted.
async fn restore(client: &Client, side: Side, node: &str, ends: &Ends) -> Result<()> {
    set_condition(client, node, true).await?;
    let nodes: Api<Node> = Api::all(client.clone());
    let health: Api<GpuNodeHealth> = Api::all(client.clone());
    let within = ends.patience.restored;
    let deadline = Instant::now() + within;
    loop {
        let back = match side {
            Side::Gpuhealth => {
                let healthy = health
                    .get_opt(node)
                    .await?
                    .and_then(|h| h.status)
                    .is_some_and(|s| s.phase == Phase::Healthy);
                healthy && !is_cordoned(&nodes.get(node).await?)
            }
            Side::Nhc => !ends.remediations.present(node),
        };
        if back {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("{node} was not itself again within {within:?}").into());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `nodes` of one side fail at once: the time until each one's first
/// action, and what the tool spent meanwhile.
async fn storm(
    b: &Bench<'_>,
    peer: &Running,
    pids: Pids,
    ends: &Ends,
    side: Side,
    nodes: &[String],
) -> Result<StormCost> {
    let pid = pids.of(side);
    // The peak is since this write, not since the process started.
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5")?;
    let before = requests(b, peer, side).await?;
    let cpu_before = stats::cpu_seconds(pid).ok_or("a process exited")?;
    let started = Instant::now();
    try_join_all(nodes.iter().map(|n| set_condition(b.client, n, false))).await?;
    let last = join_all(nodes.iter().map(|n| ends.awaited(side, n, started)))
        .await
        .into_iter()
        .map(|seen| seen.map(|(_, acted)| acted))
        .collect::<Option<Vec<Instant>>>()
        .and_then(|all| all.into_iter().max());
    let after = requests(b, peer, side).await?;
    let cpu = stats::cpu_seconds(pid).ok_or("a process exited")? - cpu_before;
    let (_, peak) = stats::memory_kib(pid).ok_or("a process exited")?;
    try_join_all(nodes.iter().map(|n| restore(b.client, side, n, ends))).await?;
    let (all, _) = requests_and_writes(side, &before, &after);
    let n = nodes.len() as f64;
    Ok(StormCost {
        nodes: nodes.len(),
        all_acted_seconds: last.map(|t| t.duration_since(started).as_secs_f64()),
        requests_per_node: all / n,
        cpu_seconds_per_node: cpu / n,
        peak_rss_mib: peak as f64 / 1024.0,
    })
}

/// Sets `node`'s [`CONDITION`], as a node problem detector would:
/// a strategic merge of the one condition, its transition time now.
async fn set_condition(client: &Client, node: &str, healthy: bool) -> Result<()> {
    let now = k8s_openapi::jiff::Timestamp::now().to_string();
    let (status, reason) = if healthy {
        ("True", "GpuHealthy")
    } else {
        ("False", "BenchFault")
    };
    let patch = json!({"status": {"conditions": [{
        "type": CONDITION,
        "status": status,
        "reason": reason,
        "message": "set by gpuhealth-bench",
        "lastTransitionTime": now,
        "lastHeartbeatTime": now,
    }]}});
    Api::<Node>::all(client.clone())
        .patch_status(node, &PatchParams::default(), &Patch::Strategic(patch))
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_side_takes_every_other_node_of_the_pool() {
        let pool: Vec<String> = (0..7).map(|i| format!("n{i}")).collect();
        let sides = Sides::from(&pool, 3);
        assert_eq!(sides.gpuhealth, ["n0", "n2", "n4"]);
        assert_eq!(sides.nhc, ["n1", "n3", "n5"]);
        assert_eq!(
            Sides::from(&pool, 10).nhc.len(),
            3,
            "no more pairs than the pool holds"
        );
    }
}
