//! The large fleet, after every other phase: the fleet grows past `--nodes`
//! to `--large` nodes whose GPUs run no pods (KWOK on two cores keeps that
//! many nodes, not their pods), `--large-step` nodes at a time, watched by
//! a fresh operator, its idle memory measured after each step. At each of
//! `--large-measure-at` and at `--large`: time to quarantine against the
//! floor over `--large-faults` faults a side, then faults during a policy
//! change's pass; at `--large-peer-at`, the peer beside gpuhealth. A step
//! that fails ends the phase and says why; what was measured before it is
//! kept.

use std::{
    collections::HashSet,
    time::{Duration, Instant},
};

use gpuhealth_api::GpuHealthPolicy;
use gpuhealth_e2e::process::Process;
use kube::{Api, Client};

use crate::{
    Args, Result,
    fleet::{self, GROUP, Workload},
    measure,
    peer::Nhc,
    policy::policy,
    results::{Large, LargeAt, PeerSize, Step},
    say,
    watch::Cordons,
};

/// What the phase needs of the run.
pub struct Run<'a> {
    pub args: &'a Args,
    pub client: &'a Client,
    pub cordons: &'a Cordons,
    pub nhc: Option<&'a Nhc>,
}

/// The large fleet's figures, and the peer's comparison at its size if the
/// peer runs (it joins the other sizes' comparisons).
pub async fn measure(run: &Run<'_>) -> (Large, Option<PeerSize>) {
    let mut large = Large {
        target: run.args.large,
        reached: run.args.nodes,
        ..Default::default()
    };
    let mut peer = None;
    if let Err(e) = grow_and_measure(run, &mut large, &mut peer).await {
        say(&format!("the large fleet stopped: {e}"));
        large.stopped = Some(e.to_string());
    }
    (large, peer)
}

async fn grow_and_measure(
    run: &Run<'_>,
    large: &mut Large,
    peer: &mut Option<PeerSize>,
) -> Result<()> {
    let (args, client) = (run.args, run.client);
    // A fresh operator, so that its memory is not the earlier phases'
    // high-water mark; a Lease of its own, so it leads at once.
    let (mut operator, pid) = measure::start_operator("bench-operator-large").await?;
    let pods = args.nodes * (8 + args.cpu_pods + args.extra_pods);
    large
        .memory
        .push(measure::idle_memory(&operator, pid, args.nodes, pods).await?);
    // The time to quarantine's policy, as in the phase at `--nodes`.
    let policies: Api<GpuHealthPolicy> = Api::all(client.clone());
    crate::policy::replace_spec(&policies, policy(GROUP, "100%").spec).await?;
    // Nodes of this phase only (the earlier phases may have left theirs
    // fenced or labelled), each failed at one size only.
    let mut failed: HashSet<String> = HashSet::new();
    while large.reached < args.large {
        let to = (large.reached + args.large_step).min(args.large);
        say(&format!(
            "the large fleet: building up to {to} nodes with no pods"
        ));
        let started = Instant::now();
        let grown = async {
            fleet::grow(client, large.reached, to, Workload::Idle).await?;
            measure::taken_in(client, to).await
        };
        while_running(&mut operator, grown).await?;
        large.steps.push(Step {
            nodes: to,
            seconds: started.elapsed().as_secs_f64(),
        });
        large.reached = to;
        large
            .memory
            .push(measure::idle_memory(&operator, pid, to, pods).await?);
        if args.large_sizes_measured().contains(&to) {
            let mut pool = unfailed(args, to, &failed);
            let at = faults_at(run, &operator, to, &mut pool).await?;
            failed.extend(at.nodes_failed());
            large.at.push(at);
            if let Some(nhc) = run.nhc.filter(|_| to == args.large_peer_at.min(args.large)) {
                *peer = Some(beside_the_peer(run, nhc, &operator, pid, pool, to).await?);
            }
        }
    }
    if let (Some(first), Some(last)) = (large.memory.first(), large.memory.last())
        && last.nodes > first.nodes
    {
        large.kib_per_node =
            (last.rss_mib - first.rss_mib) * 1024.0 / (last.nodes - first.nodes) as f64;
    }
    // The operator is killed as it drops.
    Ok(())
}

/// The phase's nodes up to `size` that no fault has touched, shuffled by
/// the seed.
fn unfailed(args: &Args, size: usize, failed: &HashSet<String>) -> Vec<String> {
    let mut pool: Vec<String> = (args.nodes..size)
        .map(fleet::node_name)
        .filter(|n| !failed.contains(n))
        .collect();
    measure::shuffle(&mut pool, args.seed.wrapping_add(size as u64));
    pool
}

/// At `size` nodes: time to quarantine against the floor, then the faults
/// during a policy change's pass, on nodes drawn from `pool`.
async fn faults_at(
    run: &Run<'_>,
    operator: &Process,
    size: usize,
    pool: &mut Vec<String>,
) -> Result<LargeAt> {
    let args = run.args;
    let floor_set: Vec<String> = pool.drain(..args.large_faults).collect();
    let gpuhealth_set: Vec<String> = pool.drain(..args.large_faults).collect();
    let pass_set: Vec<String> = pool.drain(..args.pass_faults).collect();
    let time_to_quarantine = measure::time_to_quarantine(
        args,
        run.client,
        run.cordons,
        operator,
        &floor_set,
        &gpuhealth_set,
    )
    .await?;
    let during_pass = if pass_set.is_empty() {
        None
    } else {
        Some(crate::during_pass::measure(args, run.client, run.cordons, &pass_set).await?)
    };
    Ok(LargeAt {
        nodes: size,
        floor_nodes: floor_set,
        gpuhealth_nodes: gpuhealth_set,
        pass_nodes: pass_set,
        time_to_quarantine,
        during_pass,
    })
}

/// The comparison with the peer at `size`, on nodes drawn from `pool`.
async fn beside_the_peer(
    run: &Run<'_>,
    nhc: &Nhc,
    operator: &Process,
    pid: u32,
    pool: Vec<String>,
    size: usize,
) -> Result<PeerSize> {
    let args = Args {
        peer_faults: run.args.large_peer_faults,
        ..run.args.clone()
    };
    let bench = crate::versus::Bench {
        args: &args,
        client: run.client,
        cordons: run.cordons,
        operator,
        operator_pid: pid,
        nhc,
    };
    let sides = measure::sides_from(&args, pool, size);
    crate::versus::at_size(&bench, size, &sides).await
}

/// `step`'s outcome, or the operator's own last error as soon as it exits
/// (it exits when it loses its leader Lease), rather than the step's wait
/// running out with nobody to take the nodes in.
async fn while_running<T>(
    operator: &mut Process,
    step: impl Future<Output = Result<T>>,
) -> Result<T> {
    tokio::pin!(step);
    loop {
        tokio::select! {
            out = &mut step => return out,
            () = tokio::time::sleep(Duration::from_secs(1)) => {
                if operator.has_exited() {
                    let text = operator.log_text();
                    let last = text.lines().rev().find(|l| l.contains("ERROR")).unwrap_or("no error logged");
                    return Err(format!("the operator exited: {last}").into());
                }
            }
        }
    }
}
