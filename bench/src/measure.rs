//! Measurements more than one phase takes: the operator at rest, its
//! memory, the fleet taken in, time to quarantine against the floor.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use futures::future::try_join_all;
use gpuhealth_api::GpuNodeHealth;
use gpuhealth_e2e::{
    operator::{self, Options},
    process::Process,
    wait,
};
use kube::{Api, Client, runtime::watcher};

use crate::{
    Args, Result,
    fleet::{self, GROUP, recovered},
    results::{MemoryPoint, StageFigures, TimeToQuarantine},
    say, stats, versus,
    watch::{self, Cordons},
};

/// The benchmark's policy is named after the simulation group.
pub const POLICY: &str = GROUP;
/// The longest any one step may take before the run is called failed.
pub const STEP: Duration = Duration::from_secs(900);

/// The operator as the bench runs it (a release build where `make bench`
/// built one, its own leader-election timings, a Lease named after it),
/// and its pid.
pub async fn start_operator(name: &str) -> Result<(Process, u32)> {
    let operator = operator::start_with(
        name,
        Options {
            log: Some("info,kube=warn".into()),
            default_lease_timings: true,
            ..Default::default()
        },
    )
    .await?;
    let pid = operator.pid().ok_or("the operator exited at start")?;
    Ok((operator, pid))
}

/// Time to quarantine: the floor and gpuhealth in the same window, faults
/// alternating between their nodes, so that both face the same load
/// (gpuhealth's own drains of earlier faults included). The policy leaves
/// the floor's nodes alone while they carry the label. Returns once every
/// node is itself again.
pub async fn time_to_quarantine(
    args: &Args,
    client: &Client,
    cordons: &Cordons,
    operator: &Process,
    floor_set: &[String],
    gpuhealth_set: &[String],
) -> Result<TimeToQuarantine> {
    say(&format!(
        "time to quarantine: the floor and gpuhealth, alternating, {} faults each",
        floor_set.len()
    ));
    fleet::label(client, floor_set, watch::FLOOR_LABEL, Some("true")).await?;
    let alternating: Vec<String> = floor_set
        .iter()
        .zip(gpuhealth_set)
        .flat_map(|(f, g)| [f.clone(), g.clone()])
        .collect();
    let stages_before = stages(operator).await?;
    let samples = {
        let _floor = watch::floor(client);
        inject_one_at_a_time(args, client, cordons, &alternating).await?
    };
    let stages_after = stages(operator).await?;
    let of = |set: &[String]| -> (Vec<f64>, Vec<String>) {
        let mut taken = Vec::new();
        let mut missed = Vec::new();
        for (node, sample) in samples.iter().filter(|(n, _)| set.contains(n)) {
            match sample {
                Some(s) => taken.push(*s),
                None => missed.push(node.clone()),
            }
        }
        (taken, missed)
    };
    let mut ttq = TimeToQuarantine::of(of(floor_set), of(gpuhealth_set));
    ttq.reconcile_stages = stages_after
        .iter()
        .map(|(stage, after)| {
            let during = after.since(stages_before.get(stage).unwrap_or(&Default::default()));
            (stage.clone(), StageFigures::of(&during))
        })
        .collect();
    if !ttq.gpuhealth_missed.is_empty() {
        return Err("gpuhealth did not cordon every sick node".into());
    }
    recovered(client, gpuhealth_set).await?;
    try_join_all(floor_set.iter().map(|n| fleet::restore(client, n))).await?;
    fleet::label(client, floor_set, watch::FLOOR_LABEL, None).await?;
    Ok(ttq)
}

/// The nodes of a comparison at `size`: up to `--peer-nodes` each, drawn
/// from `pool` by the seed.
pub fn sides_from(args: &Args, mut pool: Vec<String>, size: usize) -> versus::Sides {
    shuffle(&mut pool, args.seed.wrapping_add(size as u64));
    let k = args.peer_nodes.min(pool.len() / 2).max(1);
    versus::Sides::from(&pool, k)
}

/// The operator's `gpuhealth_reconcile_stage_seconds`, by stage.
pub async fn stages(operator: &Process) -> Result<BTreeMap<String, stats::Histogram>> {
    Ok(stats::histograms(
        &operator.scrape().await?,
        "gpuhealth_reconcile_stage_seconds",
        "stage",
    ))
}

/// Waits until the operator keeps a `GpuNodeHealth` for `n` fleet nodes.
pub async fn taken_in(client: &Client, n: usize) -> Result<()> {
    wait::until_set(
        Api::<GpuNodeHealth>::all(client.clone()),
        watcher::Config::default(),
        &format!("{n} nodes taken in"),
        STEP,
        |all| {
            all.values()
                .filter(|h| h.status.as_ref().and_then(|s| s.policy.as_deref()) == Some(POLICY))
                .count()
                >= n
        },
    )
    .await?;
    Ok(())
}

/// The operator's RSS once it is idle.
pub async fn idle_memory(
    operator: &Process,
    pid: u32,
    nodes: usize,
    pods: usize,
) -> Result<MemoryPoint> {
    idle(operator, nodes).await?;
    let (rss, _) = stats::memory_kib(pid).ok_or("the operator exited")?;
    say(&format!(
        "idle at {nodes} nodes, {pods} pods: {} MiB",
        rss / 1024
    ));
    Ok(MemoryPoint {
        nodes,
        pods,
        rss_mib: rss as f64 / 1024.0,
    })
}

/// Returns once the operator is at rest: in a 5 s window it reconciled no
/// more than the background (KWOK renews each node's status every ten
/// minutes and the operator looks at each node every five: at most one
/// reconcile per node per five minutes).
pub async fn idle(operator: &Process, nodes: usize) -> Result<()> {
    let reconciles = |text: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix("gpuhealth_reconcile_duration_seconds_count "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0.0)
    };
    let background = 1.0 + nodes as f64 * 5.0 / 300.0;
    let deadline = Instant::now() + STEP;
    let mut last = reconciles(&operator.scrape().await?);
    loop {
        tokio::time::sleep(Duration::from_secs(5)).await;
        let now = reconciles(&operator.scrape().await?);
        if now - last <= background {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "the operator never came to rest ({} reconciles in 5 s)",
                now - last
            )
            .into());
        }
        last = now;
    }
}

/// Breaks one node every `--fault-interval-ms` and returns, for each, the
/// seconds from the report's write seen on a watch to the cordon seen on
/// the same watch, or none for a node not cordoned within two minutes of
/// the last fault (reported as missed, not dropped silently).
async fn inject_one_at_a_time(
    args: &Args,
    client: &Client,
    cordons: &Cordons,
    nodes: &[String],
) -> Result<Vec<(String, Option<f64>)>> {
    let mut written = Vec::new();
    for node in nodes {
        let before = Instant::now();
        fleet::break_gpu(client, node).await?;
        written.push((node.clone(), before));
        tokio::time::sleep(Duration::from_millis(args.fault_interval_ms)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut samples = Vec::new();
    for (node, at) in written {
        let sample = watch::awaited(deadline, || cordons.quarantine(&node, at)).await;
        let sample = sample.map(|(sick, cordoned)| cordoned.duration_since(sick).as_secs_f64());
        samples.push((node, sample));
    }
    let missed: Vec<&String> = samples
        .iter()
        .filter(|(_, s)| s.is_none())
        .map(|(n, _)| n)
        .collect();
    if !missed.is_empty() {
        say(&format!(
            "{} faults never seen cordoned: {missed:?}",
            missed.len()
        ));
    }
    Ok(samples)
}

/// A fixed shuffle (xorshift), so a seed names the same nodes every run.
pub fn shuffle(items: &mut [String], seed: u64) {
    let mut state = seed.max(1);
    for i in (1..items.len()).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        items.swap(i, (state % (i as u64 + 1)) as usize);
    }
}
