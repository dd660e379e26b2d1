//! The results of a run, as `<label>.json` holds them (`bench/plot.py`
//! reads them back).

use std::collections::BTreeMap;

use k8s_openapi::jiff::Timestamp;
use serde::Serialize;

use crate::{Args, stats::Distribution};

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
    pub gangs: GangComparison,
    pub capacity: Capacity,
    pub peer: Peer,
    pub detection: Detection,
    pub large: Large,
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

/// What a training gang loses to one bad GPU, `Whole` against `Member`
/// (`bench/src/gangs.rs`).
#[derive(Debug, Default, Serialize)]
pub struct GangComparison {
    pub nodes: usize,
    pub ranks: usize,
    /// The policy's `drain.gangs.notice`.
    pub notice_seconds: f64,
    /// `Whole`: from the fault to every rank told, and to the last gone.
    pub whole_all_told_seconds: f64,
    pub whole_seconds: f64,
    /// Whether every rank was told before the first left.
    pub whole_told_before_any_left: bool,
    /// `Member`: from the fault to the bad GPU's rank gone.
    pub member_seconds: f64,
    /// Ranks `Member` left running, once the node had recovered.
    pub member_ranks_left: usize,
    /// How long the other ranks hang under `Member`: the job's collective
    /// timeout, stated (`--gang-hang-timeout-secs`), not measured.
    pub hang_timeout_seconds: f64,
    pub whole_gpu_hours: f64,
    pub member_gpu_hours: f64,
    /// `Whole`'s GPU-hours over `Member`'s: under 1 loses less.
    pub ratio: f64,
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

/// One tool's reaction to the bench's condition turned `False`, and what
/// it costs.
#[derive(Debug, Default, Serialize)]
pub struct Reaction {
    /// From the condition seen to the first action seen.
    pub first_action: Distribution,
    pub seconds: Vec<f64>,
    /// Faults with no first action within the comparison's patience
    /// (two minutes, or two of the peer's passes where those are longer).
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

/// The large fleet (`--large`): how far it grew and what was measured there.
#[derive(Debug, Default, Serialize)]
pub struct Large {
    /// The size asked for; 0: the phase did not run.
    pub target: usize,
    /// The largest size the operator took in.
    pub reached: usize,
    /// Seconds to create each step's nodes and see the operator take them in.
    pub steps: Vec<Step>,
    /// The fresh operator at rest, at `--nodes` and after each step.
    pub memory: Vec<MemoryPoint>,
    /// RSS growth per node from `--nodes` to the size reached.
    pub kib_per_node: f64,
    /// The faults, at each size they were measured at.
    pub at: Vec<LargeAt>,
    /// Why the phase ended before its end, if it did.
    pub stopped: Option<String>,
}

/// The large fleet's faults at one size.
#[derive(Debug, Default, Serialize)]
pub struct LargeAt {
    pub nodes: usize,
    /// The nodes each measure failed.
    pub floor_nodes: Vec<String>,
    pub gpuhealth_nodes: Vec<String>,
    pub pass_nodes: Vec<String>,
    pub time_to_quarantine: TimeToQuarantine,
    /// Faults during a policy change's pass over every node.
    pub during_pass: Option<DuringPass>,
}

impl LargeAt {
    pub fn nodes_failed(&self) -> impl Iterator<Item = String> + '_ {
        self.floor_nodes
            .iter()
            .chain(&self.gpuhealth_nodes)
            .chain(&self.pass_nodes)
            .cloned()
    }
}

/// Time to quarantine of faults that come during a policy change's pass.
#[derive(Debug, Default, Serialize)]
pub struct DuringPass {
    /// How long after the change each fault came.
    pub delay_ms: u64,
    pub gpuhealth: Distribution,
    pub seconds: Vec<f64>,
}

#[derive(Debug, Default, Serialize)]
pub struct Step {
    pub nodes: usize,
    pub seconds: f64,
}
