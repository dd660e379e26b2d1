//! The results: one JSON document per run, and a Markdown summary that
//! states each figure against its target. `bench/plot.py` draws the plots
//! from the JSON.

use std::{collections::BTreeMap, fmt::Write, path::PathBuf};

use k8s_openapi::jiff::Timestamp;
use serde::Serialize;

use crate::{Args, Result, stats::Distribution};

#[derive(Debug, Default, Serialize)]
pub struct Results {
    pub label: String,
    pub date: String,
    pub machine: Machine,
    pub apiserver: String,
    /// `release` or `debug`: the operator build that was measured.
    pub operator_build: String,
    pub nodes: usize,
    pub pods_per_node: usize,
    pub fleet_build_seconds: f64,
    pub memory: Vec<MemoryPoint>,
    pub quiet: Quiet,
    pub time_to_quarantine: TimeToQuarantine,
    pub storm: Storm,
    pub drain: DrainComparison,
    pub capacity: Capacity,
    pub peer: Peer,
    pub detection: Detection,
    pub operator_log: String,
}

#[derive(Debug, Default, Serialize)]
pub struct Machine {
    pub cpus: usize,
    pub memory_gib: f64,
    pub kernel: String,
}

#[derive(Debug, Default, Serialize)]
pub struct MemoryPoint {
    pub nodes: usize,
    pub pods: usize,
    pub rss_mib: f64,
}

#[derive(Debug, Default, Serialize)]
pub struct Quiet {
    pub seconds: u64,
    /// Writes other than the leader Lease's renewals.
    pub operator_writes_per_minute: f64,
    pub operator_lease_writes_per_minute: f64,
    pub agents: usize,
    /// The agents' `--refresh`: each rewrites its report and its condition
    /// that often with nothing new (two writes).
    #[serde(default)]
    pub agent_refresh_secs: u64,
    /// The median agent's writes.
    pub agent_writes_per_minute: f64,
}

#[derive(Debug, Default, Serialize)]
pub struct TimeToQuarantine {
    pub floor: Distribution,
    pub gpuhealth: Distribution,
    pub ratio_p50: f64,
    pub ratio_p99: f64,
    pub floor_seconds: Vec<f64>,
    pub gpuhealth_seconds: Vec<f64>,
    /// Faults whose cordon was never seen within two minutes.
    pub floor_missed: Vec<String>,
    pub gpuhealth_missed: Vec<String>,
    /// Where the operator's node reconciles spent their time while the
    /// faults were injected, by stage (its `gpuhealth_reconcile_stage_seconds`).
    pub reconcile_stages: BTreeMap<String, StageFigures>,
}

#[derive(Debug, Default, Serialize)]
pub struct StageFigures {
    pub count: f64,
    pub mean_seconds: f64,
    /// The upper bound of the histogram bucket holding the 99th percentile.
    pub p99_at_most_seconds: f64,
}

impl StageFigures {
    pub fn of(h: &crate::stats::Histogram) -> StageFigures {
        StageFigures {
            count: h.count,
            mean_seconds: h.mean(),
            p99_at_most_seconds: h.quantile_at_most(0.99),
        }
    }
}

impl TimeToQuarantine {
    pub fn of(
        (floor, floor_missed): (Vec<f64>, Vec<String>),
        (gpuhealth, gpuhealth_missed): (Vec<f64>, Vec<String>),
    ) -> TimeToQuarantine {
        let f = Distribution::of(floor.clone());
        let g = Distribution::of(gpuhealth.clone());
        TimeToQuarantine {
            ratio_p50: g.p50 / f.p50,
            ratio_p99: g.p99 / f.p99,
            floor: f,
            gpuhealth: g,
            floor_seconds: floor,
            gpuhealth_seconds: gpuhealth,
            floor_missed,
            gpuhealth_missed,
            reconcile_stages: BTreeMap::new(),
        }
    }
}

#[derive(Debug, Default, Serialize)]
pub struct Storm {
    pub nodes: usize,
    pub max_concurrent: u32,
    pub wall_seconds: f64,
    pub remediations_per_minute: f64,
    pub requests_per_remediation: f64,
    pub requests_per_remediation_by_verb: BTreeMap<String, f64>,
    /// Keyed `verb resource`, so a change in cost names what it is spent on.
    pub requests_per_remediation_by_resource: BTreeMap<String, f64>,
    pub cpu_seconds_per_remediation: f64,
    pub peak_rss_mib: f64,
}

#[derive(Debug, Default, Serialize)]
pub struct DrainComparison {
    pub pods: usize,
    pub pods_behind_pdbs: usize,
    pub gpuhealth_seconds: Vec<f64>,
    pub kubectl_seconds: Vec<f64>,
    /// gpuhealth's median over kubectl drain's: under 1 is faster.
    pub ratio_of_medians: f64,
}

/// The capacity an incident costs: per-GPU quarantine against node-wide,
/// the same incidents on the same nodes.
#[derive(Debug, Default, Serialize)]
pub struct Capacity {
    /// Incidents under each scope.
    pub incidents: usize,
    /// Schedulable GPU-seconds each incident took away, fenced alone.
    pub per_gpu_gpu_seconds: Vec<f64>,
    /// Incidents under `Auto` that cordoned their node after all.
    pub per_gpu_cordoned: usize,
    /// The same, with the node cordoned.
    pub node_wide_gpu_seconds: Vec<f64>,
    pub node_wide_cordoned: usize,
    /// Per-GPU's median over node-wide's: the share of capacity it costs.
    pub ratio_of_medians: f64,
}

/// From the Xid reaching the agent to the cordon, on each path.
#[derive(Debug, Default, Serialize)]
pub struct Detection {
    /// Real agents, each serving a node of its own.
    pub agents: usize,
    pub kernel_log: PathFigures,
    pub nvml: PathFigures,
}

#[derive(Debug, Default, Serialize)]
pub struct PathFigures {
    /// From the Xid's write to the agent's report naming it, seen on a watch.
    pub to_report: Distribution,
    /// From the Xid's write to the cordon seen on the same watch.
    pub to_cordon: Distribution,
    pub seconds: Vec<f64>,
    /// Faults not cordoned within two minutes.
    pub missed: usize,
}

impl PathFigures {
    pub fn of(to_report: Vec<f64>, to_cordon: Vec<f64>, missed: usize) -> PathFigures {
        PathFigures {
            to_report: Distribution::of(to_report),
            to_cordon: Distribution::of(to_cordon.clone()),
            seconds: to_cordon,
            missed,
        }
    }
}

/// gpuhealth beside Medik8s Node Healthcheck, at each fleet size.
#[derive(Debug, Default, Serialize)]
pub struct Peer {
    pub ran: bool,
    pub why_not: String,
    pub sizes: Vec<PeerSize>,
}

#[derive(Debug, Default, Serialize)]
pub struct PeerSize {
    pub nodes: usize,
    pub gpuhealth: Reaction,
    pub nhc: Reaction,
    /// gpuhealth's time to its first action over the peer's.
    pub ratio_p50: f64,
    pub ratio_p99: f64,
}

/// One tool's reaction to `GpuHealthy=False`, and what it costs.
#[derive(Debug, Default, Serialize)]
pub struct Reaction {
    /// From the condition seen to the first action seen.
    pub first_action: Distribution,
    pub seconds: Vec<f64>,
    /// Faults with no first action within two minutes.
    pub missed: usize,
    pub rest: Cost,
    pub storm: StormCost,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Cost {
    pub rss_mib: f64,
    pub requests_per_minute: f64,
    pub writes_per_minute: f64,
    pub cpu_seconds_per_minute: f64,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct StormCost {
    pub nodes: usize,
    /// Until the last node's first action; none if one never came.
    pub all_acted_seconds: Option<f64>,
    pub requests_per_node: f64,
    pub cpu_seconds_per_node: f64,
    /// The peak resident memory from the storm's start.
    pub peak_rss_mib: f64,
}

impl Results {
    pub fn new(args: &Args) -> Results {
        let date = Timestamp::now().strftime("%Y-%m-%d").to_string();
        let memory_kib: f64 = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines()
                    .find_map(|l| l.strip_prefix("MemTotal:"))
                    .and_then(|v| v.split_whitespace().next()?.parse().ok())
            })
            .unwrap_or(0.0);
        Results {
            label: args.label.clone().unwrap_or_else(|| date.clone()),
            date,
            machine: Machine {
                cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
                memory_gib: (memory_kib / 1024.0 / 1024.0 * 10.0).round() / 10.0,
                kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                    .unwrap_or_default()
                    .trim()
                    .to_owned(),
            },
            operator_build: match std::env::var("GPUHEALTH_BIN_DIR") {
                Ok(dir) if dir.contains("release") => "release".into(),
                _ => "debug".into(),
            },
            nodes: args.nodes,
            pods_per_node: 8 + args.cpu_pods,
            ..Default::default()
        }
    }
}

/// Writes `<label>.json` and `<label>.md` under `--out`, and the summary
/// again as `latest.md`.
pub fn write(args: &Args, results: &Results) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(&args.out)?;
    let json = args.out.join(format!("{}.json", results.label));
    std::fs::write(&json, serde_json::to_string_pretty(results)? + "\n")?;
    let summary = summary(results);
    let md = args.out.join(format!("{}.md", results.label));
    std::fs::write(&md, &summary)?;
    let latest = args.out.join("latest.md");
    std::fs::write(&latest, &summary)?;
    Ok(vec![json, md, latest])
}

fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "**not met**" }
}

/// The Markdown summary.
pub fn summary(r: &Results) -> String {
    let mut s = String::new();
    let ttq = &r.time_to_quarantine;
    let small = r.memory.first();
    let full = r.memory.get(1);
    let more_pods = r.memory.get(2);
    let growth_kib = match (small, full) {
        (Some(a), Some(b)) if b.nodes > a.nodes => {
            (b.rss_mib - a.rss_mib) * 1024.0 / (b.nodes - a.nodes) as f64
        }
        _ => 0.0,
    };
    // The plots bench/plot.py draws from this run's figures.
    let mut plots = vec!["quarantine", "memory"];
    if !r.peer.sizes.is_empty() {
        plots.push("peer");
    }
    if r.detection.agents > 0 {
        plots.push("detection");
    }
    let plots: Vec<String> = plots
        .iter()
        .map(|p| format!("`{}-{p}.png`", r.label))
        .collect();
    let _ = writeln!(
        s,
        "# gpuhealth benchmark, {label}\n\n\
         Generated by `make bench` ({nodes} simulated 8-GPU nodes, {ppn} pods each) on a \
         {cpus}-core, {mem} GiB machine (kernel {kernel}), kube-apiserver {api}, KWOK; \
         the operator is a {build} build. Figures: `{label}.json`; plots: {plots}. \
         Timings on a shared machine are noisy: ratios are measured in the same run.\n",
        plots = plots.join(", "),
        label = r.label,
        nodes = r.nodes,
        ppn = r.pods_per_node,
        cpus = r.machine.cpus,
        mem = r.machine.memory_gib,
        kernel = r.machine.kernel,
        api = r.apiserver,
        build = r.operator_build,
    );
    let _ = writeln!(s, "| figure | value | target | |\n|---|---|---|---|");
    let _ = writeln!(
        s,
        "| time to quarantine, gpuhealth (p50 / p99 / max) | {:.3} / {:.3} / {:.3} s | | |",
        ttq.gpuhealth.p50, ttq.gpuhealth.p99, ttq.gpuhealth.max
    );
    let _ = writeln!(
        s,
        "| time to quarantine, floor (p50 / p99 / max) | {:.3} / {:.3} / {:.3} s | | |",
        ttq.floor.p50, ttq.floor.p99, ttq.floor.max
    );
    let _ = writeln!(
        s,
        "| faults never seen cordoned (floor / gpuhealth) | {} / {} | 0 | |",
        ttq.floor_missed.len(),
        ttq.gpuhealth_missed.len()
    );
    let _ = writeln!(
        s,
        "| gpuhealth ÷ floor (p50 / p99) | {:.2} / {:.2} | both within 1.5× | {} |",
        ttq.ratio_p50,
        ttq.ratio_p99,
        verdict(ttq.ratio_p50 <= 1.5 && ttq.ratio_p99 <= 1.5)
    );
    if !ttq.reconcile_stages.is_empty() {
        let stages: Vec<String> = ttq
            .reconcile_stages
            .iter()
            .filter(|(_, f)| f.count > 0.0)
            .map(|(stage, f)| {
                format!(
                    "{stage} {:.1} / ≤{:.1} ms ({:.0})",
                    f.mean_seconds * 1e3,
                    f.p99_at_most_seconds * 1e3,
                    f.count
                )
            })
            .collect();
        let _ = writeln!(
            s,
            "| while faults arrived, reconcile stages (mean / p99 bound, count) | {} | | |",
            stages.join("; ")
        );
    }
    let st = &r.storm;
    let _ = writeln!(
        s,
        "| storm: {} nodes at once, maxConcurrent {} | all back in {:.1} s ({:.1} remediations/min) | | |",
        st.nodes, st.max_concurrent, st.wall_seconds, st.remediations_per_minute
    );
    let verbs: Vec<String> = st
        .requests_per_remediation_by_verb
        .iter()
        .map(|(v, n)| format!("{v} {n:.1}"))
        .collect();
    let _ = writeln!(
        s,
        "| API requests per remediation | {:.1} ({}) | | |",
        st.requests_per_remediation,
        verbs.join(", ")
    );
    let _ = writeln!(
        s,
        "| CPU per remediation | {:.3} s | | |",
        st.cpu_seconds_per_remediation
    );
    for (i, m) in r.memory.iter().enumerate() {
        // The full scale, before the extra pods.
        let target = if i == 1 {
            ("under 64 MiB at 1,000 nodes", verdict(m.rss_mib < 64.0))
        } else {
            ("", "")
        };
        let _ = writeln!(
            s,
            "| operator RSS idle, {} nodes, {} pods | {:.1} MiB | {} | {} |",
            m.nodes, m.pods, m.rss_mib, target.0, target.1
        );
    }
    let _ = writeln!(
        s,
        "| RSS growth per additional idle node | {growth_kib:.2} KiB | under 8 KiB | {} |",
        verdict(growth_kib < 8.0)
    );
    if let (Some(f), Some(p)) = (full, more_pods) {
        let _ = writeln!(
            s,
            "| RSS change with {} more pods | {:+.1} MiB | follows work, not pods | |",
            p.pods.saturating_sub(f.pods),
            p.rss_mib - f.rss_mib
        );
    }
    let _ = writeln!(
        s,
        "| operator RSS peak (storm) | {:.1} MiB | | |",
        st.peak_rss_mib
    );
    let q = &r.quiet;
    let _ = writeln!(
        s,
        "| quiet cluster: operator writes/min ({} s) | {:.2} (plus {:.1} Lease renewals) | 0 | {} |",
        q.seconds,
        q.operator_writes_per_minute,
        q.operator_lease_writes_per_minute,
        verdict(q.operator_writes_per_minute == 0.0)
    );
    // Two writes (report, condition) per refresh, and nothing else: at
    // most one refresh more than fit in the window.
    let most = match q.agent_refresh_secs {
        0 => 0.0,
        every => 2.0 * (q.seconds / every + 1) as f64 / (q.seconds.max(1) as f64 / 60.0),
    };
    let _ = writeln!(
        s,
        "| quiet cluster: agent writes/min (median of {}, refresh every {} s) | {:.2} | at most {most:.2} (two writes a refresh) | {} |",
        q.agents,
        q.agent_refresh_secs,
        q.agent_writes_per_minute,
        verdict(q.agent_writes_per_minute <= most + 1e-9)
    );
    let d = &r.drain;
    let _ = writeln!(
        s,
        "| drain of {} pods ({} behind PDBs): gpuhealth ÷ kubectl drain, medians | {:.2} (gpuhealth {:?} s, kubectl {:?} s) | no slower | {} |",
        d.pods,
        d.pods_behind_pdbs,
        d.ratio_of_medians,
        rounded(&d.gpuhealth_seconds),
        rounded(&d.kubectl_seconds),
        verdict(d.ratio_of_medians <= 1.0)
    );
    let c = &r.capacity;
    let _ = writeln!(
        s,
        "| capacity an incident costs (schedulable GPU-seconds, medians of {}): GPU fenced alone ÷ node cordoned | {:.3} ({:.0} against {:.0}; {} of {} per-GPU incidents cordoned) | under 1 | {} |",
        c.incidents,
        c.ratio_of_medians,
        crate::stats::median(&c.per_gpu_gpu_seconds),
        crate::stats::median(&c.node_wide_gpu_seconds),
        c.per_gpu_cordoned,
        c.incidents,
        verdict(c.incidents > 0 && c.ratio_of_medians < 1.0 && c.per_gpu_cordoned == 0)
    );
    detection_rows(&mut s, &r.detection);
    peer_rows(&mut s, &r.peer);
    let _ = writeln!(
        s,
        "\nHow each figure is measured: `bench/README.md`. Causes of figures that miss their \
         target: `bench/FINDINGS.md`."
    );
    s
}

/// The rows from the Xid to the cordon, per path.
fn detection_rows(s: &mut String, d: &Detection) {
    let paths = [
        (
            "kernel log (a file polled every 200 ms; the shipped agent, not privileged, reads syslog(2) once a second)",
            &d.kernel_log,
        ),
        ("NVML event (the stand-in polls every 20 ms)", &d.nvml),
    ];
    for (path, f) in paths {
        let _ = writeln!(
            s,
            "| Xid to cordon, {path}, {} real agents (p50 / p99 over {}; to the report p50 / p99) | {:.3} / {:.3} s ({:.3} / {:.3} s); {} missed | | |",
            d.agents,
            f.to_cordon.n,
            f.to_cordon.p50,
            f.to_cordon.p99,
            f.to_report.p50,
            f.to_report.p99,
            f.missed,
        );
    }
}

/// The rows beside the peer: per fleet size, each one's time from the
/// condition to its first action, and its cost at rest and in a storm.
fn peer_rows(s: &mut String, peer: &Peer) {
    if !peer.ran {
        let _ = writeln!(
            s,
            "| beside Medik8s Node Healthcheck | not run: {} | | |",
            peer.why_not
        );
        return;
    }
    for size in &peer.sizes {
        let (g, n) = (&size.gpuhealth, &size.nhc);
        let _ = writeln!(
            s,
            "| {} nodes: `GpuHealthy=False` to first action, gpuhealth (cordon) against Medik8s NHC (remediation object), p50 / p99 over {} and {} faults | {:.3} / {:.3} s against {:.3} / {:.3} s; ratio {:.2} / {:.2} ({} and {} missed) | | |",
            size.nodes,
            g.first_action.n,
            n.first_action.n,
            g.first_action.p50,
            g.first_action.p99,
            n.first_action.p50,
            n.first_action.p99,
            size.ratio_p50,
            size.ratio_p99,
            g.missed,
            n.missed,
        );
        let cost = |c: &Cost| {
            format!(
                "{:.1} MiB, {:.1} requests/min ({:.1} writes), {:.2} CPU s/min",
                c.rss_mib, c.requests_per_minute, c.writes_per_minute, c.cpu_seconds_per_minute
            )
        };
        let _ = writeln!(
            s,
            "| {} nodes at rest: gpuhealth against NHC | {} against {} | | |",
            size.nodes,
            cost(&g.rest),
            cost(&n.rest)
        );
        let storm = |c: &StormCost| {
            let all = c.all_acted_seconds.map_or("not all acted".to_owned(), |t| {
                format!("all acted in {t:.1} s")
            });
            format!(
                "{all}, {:.1} requests and {:.3} CPU s per node, peak {:.1} MiB",
                c.requests_per_node, c.cpu_seconds_per_node, c.peak_rss_mib
            )
        };
        let _ = writeln!(
            s,
            "| {} nodes, storm of {} at once: gpuhealth against NHC | {} against {} | | |",
            size.nodes,
            g.storm.nodes,
            storm(&g.storm),
            storm(&n.storm)
        );
    }
}

fn rounded(v: &[f64]) -> Vec<f64> {
    v.iter().map(|x| (x * 10.0).round() / 10.0).collect()
}
