//! The benchmark's phases, in the order they run on one cluster.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use futures::future::try_join_all;
use gpuhealth_agent::fake::{SimHardware, SimOutcome};
use gpuhealth_api::{
    GpuHealthPolicy, GpuNodeHealth,
    contract::{AnnotationValue, GPU_REPORT_ANNOTATION, GpuReport},
};
use gpuhealth_e2e::{
    agent::FakeAgent,
    crds, node_agent,
    operator::{self, Options},
    process::Process,
    reports, wait,
};
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api, Client, ResourceExt,
    api::{Patch, PatchParams, PostParams},
    runtime::watcher,
};
use serde_json::json;

use crate::{
    Args, Result, capacity, detect, drain,
    fleet::{self, GROUP, recovered},
    peer::Nhc,
    policy::policy,
    report::{MemoryPoint, Quiet, Results, StageFigures, Storm, TimeToQuarantine},
    say,
    stats::{self, WRITES},
    versus,
    watch::{self, Cordons},
};

pub const POLICY: &str = GROUP;
const OPERATOR_REQUESTS: &str = "gpuhealth_api_requests_total";
const AGENT_REQUESTS: &str = "gpuhealth_agent_api_requests_total";
/// The longest any one step may take before the run is called failed.
const STEP: Duration = Duration::from_secs(900);

pub async fn run(args: &Args) -> Result<Results> {
    let client = gpuhealth_e2e::client().await?;
    crds::install(&client).await?;
    fleet::namespace(&client).await?;
    let mut results = Results::new(args);
    results.apiserver = client.apiserver_version().await?.git_version;

    let cordons = Cordons::default();
    let _cordon_watch = cordons.watch(&client);
    // Stands in for the node agents of the whole fleet: answers resets.
    let _agent = FakeAgent::default().spawn(client.clone(), GROUP);
    let policies: Api<GpuHealthPolicy> = Api::all(client.clone());
    policies
        .create(&PostParams::default(), &policy(GROUP, "100%"))
        .await?;

    let nhc = Nhc::find(args.nhc_dir.as_deref(), args.nhc_bin.as_deref());
    if let Ok(nhc) = &nhc {
        nhc.install().await?;
    }

    // Idle memory at the small scale, at the full scale, then with more pods;
    // beside the peer as the fleet grows.
    say(&format!("building {} nodes", args.small));
    let started = Instant::now();
    fleet::grow(&client, 0, args.small, args.cpu_pods).await?;
    let operator = operator::start_with(
        "bench-operator",
        Options {
            log: Some("info,kube=warn".into()),
            default_lease_timings: true,
            ..Default::default()
        },
    )
    .await?;
    let pid = operator.pid().ok_or("the operator exited at start")?;
    taken_in(&client, args.small).await?;
    results
        .memory
        .push(idle_memory(&operator, pid, args.small, args.small * pods_per_node(args)).await?);
    // The comparison with the peer, where there is one.
    let beside = nhc.as_ref().ok().map(|nhc| versus::Bench {
        args,
        client: &client,
        cordons: &cordons,
        operator: &operator,
        operator_pid: pid,
        nhc,
    });
    let mut grown = args.small;
    let mut comparing = Duration::ZERO;
    // Nodes a comparison used: left out of the phases after it.
    let mut spent: Vec<String> = Vec::new();
    let mut sizes: Vec<usize> = args.peer_at.clone();
    sizes.sort_unstable();
    sizes.dedup();
    for &size in sizes.iter().filter(|&&n| n < args.nodes) {
        if size > grown {
            say(&format!("building up to {size} nodes"));
            fleet::grow(&client, grown, size, args.cpu_pods).await?;
            grown = size;
            taken_in(&client, size).await?;
        }
        if let Some(bench) = &beside {
            let pool: Vec<String> = (0..size)
                .map(fleet::node_name)
                .filter(|n| !spent.contains(n))
                .collect();
            let sides = sides_from(args, pool, size);
            spent.extend(sides.gpuhealth.iter().chain(&sides.nhc).cloned());
            let comparing_since = Instant::now();
            results
                .peer
                .sizes
                .push(versus::at_size(bench, size, &sides).await?);
            comparing += comparing_since.elapsed();
        }
    }
    say(&format!("building up to {} nodes", args.nodes));
    fleet::grow(&client, grown, args.nodes, args.cpu_pods).await?;
    results.fleet_build_seconds = (started.elapsed() - comparing).as_secs_f64();
    taken_in(&client, args.nodes).await?;
    let full = idle_memory(&operator, pid, args.nodes, args.nodes * pods_per_node(args)).await?;
    results.memory.push(full);
    say(&format!(
        "adding {} CPU pods to every node",
        args.extra_pods
    ));
    let names: Vec<String> = (0..args.nodes).map(fleet::node_name).collect();
    let total = args.cpu_pods + args.extra_pods;
    fleet::add_cpu_pods_everywhere(&client, &names, args.cpu_pods, total).await?;
    let pods = args.nodes * (8 + total);
    results
        .memory
        .push(idle_memory(&operator, pid, args.nodes, pods).await?);

    // Which nodes fail: disjoint sets, none of them served by a real agent
    // or used by a comparison.
    let mut pool: Vec<String> = names[..args.nodes - args.agents]
        .iter()
        .filter(|n| !spent.contains(n))
        .cloned()
        .collect();
    shuffle(&mut pool, args.seed);
    let floor_set: Vec<String> = pool.drain(..args.faults).collect();
    let gpuhealth_set: Vec<String> = pool.drain(..args.faults).collect();
    let storm_set: Vec<String> = pool.drain(..args.storm).collect();
    let agent_nodes: Vec<String> = names[args.nodes - args.agents..].to_vec();

    results.quiet = quiet(args, &client, &operator, &agent_nodes).await?;

    // Time to quarantine: the floor and gpuhealth in the same window, faults
    // alternating between their nodes, so that both face the same load
    // (gpuhealth's own drains of earlier faults included). The policy
    // leaves the floor's nodes alone while they carry the label.
    say("time to quarantine: the floor and gpuhealth, alternating");
    fleet::label(&client, &floor_set, watch::FLOOR_LABEL, Some("true")).await?;
    let alternating: Vec<String> = floor_set
        .iter()
        .zip(&gpuhealth_set)
        .flat_map(|(f, g)| [f.clone(), g.clone()])
        .collect();
    let stages_before = stages(&operator).await?;
    let samples = {
        let _floor = watch::floor(&client);
        inject_one_at_a_time(args, &client, &cordons, &alternating).await?
    };
    let stages_after = stages(&operator).await?;
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
    results.time_to_quarantine = TimeToQuarantine::of(of(&floor_set), of(&gpuhealth_set));
    results.time_to_quarantine.reconcile_stages = stages_after
        .iter()
        .map(|(stage, after)| {
            let during = after.since(stages_before.get(stage).unwrap_or(&Default::default()));
            (stage.clone(), StageFigures::of(&during))
        })
        .collect();
    if !results.time_to_quarantine.gpuhealth_missed.is_empty() {
        return Err("gpuhealth did not cordon every sick node".into());
    }
    recovered(&client, &gpuhealth_set).await?;
    try_join_all(floor_set.iter().map(|n| fleet::restore(&client, n))).await?;
    fleet::label(&client, &floor_set, watch::FLOOR_LABEL, None).await?;

    results.storm = storm(args, &client, &policies, &operator, pid, &storm_set).await?;
    results.drain = drain::compare(args, &client).await?;
    say("the capacity an incident costs: GPU fenced alone, then node cordoned");
    let capacity_set = &storm_set[..args.capacity_incidents.min(storm_set.len())];
    results.capacity = capacity::compare(&client, &policies, capacity_set).await?;
    results.detection = detect::measure(args, &client, &cordons).await?;
    results.operator_log = operator.log.display().to_string();
    match &beside {
        Some(bench) => {
            if sizes.contains(&args.nodes) {
                // Every node but the storm's (the capacity phase's may be
                // left fenced) and the agents'; the others are themselves
                // again by now.
                let pool: Vec<String> = names[..args.nodes - args.agents]
                    .iter()
                    .filter(|n| !storm_set.contains(n) && !spent.contains(n))
                    .cloned()
                    .collect();
                let sides = sides_from(args, pool, args.nodes);
                results
                    .peer
                    .sizes
                    .push(versus::at_size(bench, args.nodes, &sides).await?);
            }
            results.peer.ran = true;
        }
        None => {
            let why = nhc.as_ref().err().cloned().unwrap_or_default();
            say(&format!("the peer does not run: {why}"));
            results.peer.why_not = why;
        }
    }
    Ok(results)
}

/// The nodes of a comparison at `size`: up to `--peer-nodes` each, drawn
/// from `pool` by the seed.
fn sides_from(args: &Args, mut pool: Vec<String>, size: usize) -> versus::Sides {
    shuffle(&mut pool, args.seed.wrapping_add(size as u64));
    let k = args.peer_nodes.min(pool.len() / 2).max(1);
    versus::Sides::from(&pool, k)
}

/// The operator's `gpuhealth_reconcile_stage_seconds`, by stage.
async fn stages(operator: &Process) -> Result<BTreeMap<String, stats::Histogram>> {
    Ok(stats::histograms(
        &operator.scrape().await?,
        "gpuhealth_reconcile_stage_seconds",
        "stage",
    ))
}

fn pods_per_node(args: &Args) -> usize {
    8 + args.cpu_pods
}

async fn set_policy(policies: &Api<GpuHealthPolicy>, spec: serde_json::Value) -> Result<()> {
    policies
        .patch(
            POLICY,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": spec})),
        )
        .await?;
    Ok(())
}

/// Waits until the operator keeps a `GpuNodeHealth` for `n` fleet nodes.
async fn taken_in(client: &Client, n: usize) -> Result<()> {
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
async fn idle_memory(
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
async fn idle(operator: &Process, nodes: usize) -> Result<()> {
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

/// Nothing happens for `--quiet-secs`: what do the operator and a few real
/// agents write meanwhile?
async fn quiet(
    args: &Args,
    client: &Client,
    operator: &Process,
    nodes: &[String],
) -> Result<Quiet> {
    say(&format!(
        "a quiet cluster for {}s, with {} real agents",
        args.quiet_secs, args.agents
    ));
    let mut agents = Vec::new();
    let node_api: Api<Node> = Api::all(client.clone());
    for node in nodes {
        let pods: Vec<String> = (0..8).map(|g| format!("{node}-gpu{g}")).collect();
        let hardware = SimHardware {
            gpus: reports::healthy(fleet::NAMESPACE, &pods).gpus,
            reset: SimOutcome::Succeed,
            reboot: SimOutcome::Succeed,
            executed: Vec::new(),
            capabilities: None,
        };
        node_agent::set_hardware(client, node, &hardware).await?;
        let state = std::env::temp_dir().join(format!("gpuhealth-bench-agent-{node}"));
        let _ = std::fs::remove_dir_all(&state);
        let refresh = [
            "--backend",
            "fake",
            "--refresh",
            args.agent_refresh.as_str(),
        ];
        agents.push(
            node_agent::start_with(&format!("bench-agent-{node}"), node, &state, None, &refresh)
                .await?,
        );
        wait::until(node_api.clone(), node, STEP, |n| {
            n.annotations()
                .get(GPU_REPORT_ANNOTATION)
                .and_then(|v| GpuReport::parse(v).ok())
                .is_some_and(|r| r.source.as_deref() == Some("gpuhealth-agent/fake"))
        })
        .await?;
    }
    // Let the agents' own start-up writes and the operator's reactions pass.
    idle(operator, args.nodes).await?;
    let before_operator = stats::requests(&operator.scrape().await?, OPERATOR_REQUESTS);
    let mut before_agents = Vec::new();
    for a in &agents {
        before_agents.push(stats::requests(&a.scrape().await?, AGENT_REQUESTS));
    }
    tokio::time::sleep(args.quiet()).await;
    let after_operator = stats::requests(&operator.scrape().await?, OPERATOR_REQUESTS);
    let minutes = args.quiet_secs as f64 / 60.0;
    type Counts = BTreeMap<(String, String), f64>;
    let writes = |before: &Counts, after: &Counts, leases: bool| -> f64 {
        let by_verb = stats::by_verb(before, after, |verb, resource| {
            WRITES.contains(&verb) && (resource == "leases") == leases
        });
        // `+ 0.0`: an empty f64 sum is -0.0.
        (by_verb.values().sum::<f64>() + 0.0) / minutes
    };
    let mut agent_writes = Vec::new();
    for (a, before) in agents.iter().zip(&before_agents) {
        let after = stats::requests(&a.scrape().await?, AGENT_REQUESTS);
        agent_writes.push(writes(before, &after, false));
    }
    Ok(Quiet {
        seconds: args.quiet_secs,
        operator_writes_per_minute: writes(&before_operator, &after_operator, false),
        operator_lease_writes_per_minute: writes(&before_operator, &after_operator, true),
        agents: agents.len(),
        agent_refresh_secs: args
            .agent_refresh
            .parse::<gpuhealth_api::Duration>()
            .map_or(0, |d| d.as_std().as_secs()),
        agent_writes_per_minute: stats::median(&agent_writes),
    })
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

/// `--storm` nodes fail at once under `maxConcurrent: --max-concurrent`.
async fn storm(
    args: &Args,
    client: &Client,
    policies: &Api<GpuHealthPolicy>,
    operator: &Process,
    pid: u32,
    nodes: &[String],
) -> Result<Storm> {
    say(&format!(
        "a storm: {} nodes at once, maxConcurrent {}",
        nodes.len(),
        args.max_concurrent
    ));
    set_policy(policies, json!({"maxConcurrent": args.max_concurrent})).await?;
    let before = stats::requests(&operator.scrape().await?, OPERATOR_REQUESTS);
    let cpu_before = stats::cpu_seconds(pid).ok_or("the operator exited")?;
    let started = Instant::now();
    try_join_all(nodes.iter().map(|n| fleet::break_gpu(client, n))).await?;
    recovered(client, nodes).await?;
    let wall = started.elapsed().as_secs_f64();
    let cpu = stats::cpu_seconds(pid).ok_or("the operator exited")? - cpu_before;
    let after = stats::requests(&operator.scrape().await?, OPERATOR_REQUESTS);
    let (_, peak) = stats::memory_kib(pid).ok_or("the operator exited")?;
    let n = nodes.len() as f64;
    let not_leases = |_: &str, resource: &str| resource != "leases";
    let per_remediation: BTreeMap<String, f64> = stats::by_verb(&before, &after, not_leases)
        .into_iter()
        .map(|(verb, count)| (verb, count / n))
        .collect();
    let by_resource: BTreeMap<String, f64> = stats::delta(&before, &after, not_leases)
        .into_iter()
        .map(|((verb, resource), count)| (format!("{verb} {resource}"), count / n))
        .collect();
    say(&format!(
        "the storm's requests per remediation: {by_resource:?}"
    ));
    say(&format!("the storm took {wall:.1}s"));
    Ok(Storm {
        nodes: nodes.len(),
        max_concurrent: args.max_concurrent,
        wall_seconds: wall,
        remediations_per_minute: n / wall * 60.0,
        requests_per_remediation: per_remediation.values().sum(),
        requests_per_remediation_by_verb: per_remediation,
        requests_per_remediation_by_resource: by_resource,
        cpu_seconds_per_remediation: cpu / n,
        peak_rss_mib: peak as f64 / 1024.0,
    })
}

/// A fixed shuffle (xorshift), so a seed names the same nodes every run.
fn shuffle(items: &mut [String], seed: u64) {
    let mut state = seed.max(1);
    for i in (1..items.len()).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        items.swap(i, (state % (i as u64 + 1)) as usize);
    }
}
