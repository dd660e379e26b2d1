//! The benchmark's phases, in the order they run on one cluster.

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use futures::future::try_join_all;
use gpuhealth_agent::fake::{SimHardware, SimOutcome};
use gpuhealth_api::{
    GpuHealthPolicy,
    contract::{AnnotationValue, GPU_REPORT_ANNOTATION, GpuReport},
};
use gpuhealth_e2e::{agent::FakeAgent, crds, node_agent, process::Process, reports, wait};
use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client, ResourceExt, api::PostParams};
use serde_json::json;

use crate::{
    Args, Result, capacity, detect, drain,
    fleet::{self, GROUP, recovered},
    gangs, large,
    measure::{
        STEP, idle, idle_memory, shuffle, sides_from, start_operator, taken_in, time_to_quarantine,
    },
    peer::Nhc,
    policy::{policy, set_policy},
    results::{Quiet, Results, Storm},
    say,
    stats::{self, WRITES},
    versus,
    watch::Cordons,
};

const OPERATOR_REQUESTS: &str = "gpuhealth_api_requests_total";
const AGENT_REQUESTS: &str = "gpuhealth_agent_api_requests_total";

/// The training gang's comparison alone, on a cluster of its own, with an
/// operator of its own: `--only-gangs`.
pub async fn gangs_only(args: &Args) -> Result<Vec<std::path::PathBuf>> {
    let client = gpuhealth_e2e::client().await?;
    crds::install(&client).await?;
    let (_operator, _) = start_operator("bench-operator").await?;
    let gangs = gangs::compare(args, &client).await?;
    let mut results = Results::new(args);
    results.apiserver = client.apiserver_version().await?.git_version;
    results.gangs = gangs;
    crate::report::write_gangs(args, &results)
}

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
    fleet::grow(&client, 0, args.small, busy(args)).await?;
    let (operator, pid) = start_operator("bench-operator").await?;
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
            fleet::grow(&client, grown, size, busy(args)).await?;
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
    fleet::grow(&client, grown, args.nodes, busy(args)).await?;
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

    results.time_to_quarantine = time_to_quarantine(
        args,
        &client,
        &cordons,
        &operator,
        &floor_set,
        &gpuhealth_set,
    )
    .await?;

    results.storm = storm(args, &client, &policies, &operator, pid, &storm_set).await?;
    results.drain = drain::compare(args, &client).await?;
    results.gangs = gangs::compare(args, &client).await?;
    say("the capacity an incident costs: GPU fenced alone, then node cordoned");
    let capacity_set = &storm_set[..args.capacity_incidents.min(storm_set.len())];
    results.capacity = capacity::compare(&client, &policies, capacity_set).await?;
    results.detection = detect::measure(args, &client, &cordons).await?;
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
    results.operator_log = operator.log.display().to_string();

    if args.large > args.nodes {
        // One operator at a time acts on the fleet.
        drop(operator);
        let run = large::Run {
            args,
            client: &client,
            cordons: &cordons,
            nhc: nhc.as_ref().ok(),
        };
        let (figures, peer_size) = large::measure(&run).await;
        results.large = figures;
        results.peer.sizes.extend(peer_size);
    }
    Ok(results)
}

fn busy(args: &Args) -> fleet::Workload {
    fleet::Workload::Busy {
        cpu_pods: args.cpu_pods,
    }
}

fn pods_per_node(args: &Args) -> usize {
    8 + args.cpu_pods
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
            reset_takes: None,
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
