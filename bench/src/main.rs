//! `make bench`: gpuhealth at fleet scale on the local cluster (a real
//! kube-apiserver, KWOK nodes), measured side by side with the floor and
//! with `kubectl drain` in the same run, written to `bench/results/`.
//!
//! Phases, in order: idle memory at the small and the full scale (and with
//! more pods); a quiet cluster; time to quarantine for the floor, then for
//! gpuhealth; a storm of sick nodes under `maxConcurrent`; drains against
//! `kubectl drain`; the capacity an incident costs, per-GPU against
//! node-wide; the time from an Xid reaching a real agent to the cordon.
//! Timings on a shared machine are noisy: the summary gives medians,
//! spreads and ratios measured in the same run.

mod capacity;
mod detect;
mod drain;
mod during_pass;
mod fleet;
mod gangs;
mod large;
mod measure;
mod peer;
mod phases;
mod policy;
mod report;
mod results;
mod stats;
mod versus;
mod watch;

use std::{path::PathBuf, process::ExitCode, time::Duration};

use clap::Parser;

/// A line of the run's progress.
pub fn say(what: &str) {
    eprintln!("[bench] {what}");
}

pub type Result<T, E = Box<dyn std::error::Error + Send + Sync>> = std::result::Result<T, E>;

#[derive(Parser, Clone, Debug)]
#[command(about = "gpuhealth at fleet scale on the local cluster")]
pub struct Args {
    /// Simulated 8-GPU nodes at full scale.
    #[arg(long, default_value_t = 1000)]
    pub nodes: usize,
    /// The smaller scale idle memory is first measured at.
    #[arg(long, default_value_t = 100)]
    pub small: usize,
    /// CPU pods on each node, besides one pod per GPU.
    #[arg(long, default_value_t = 2)]
    pub cpu_pods: usize,
    /// CPU pods added to every node to show memory does not follow pods
    /// (with 5, KWOK on two cores fell minutes behind).
    #[arg(long, default_value_t = 1)]
    pub extra_pods: usize,
    /// Faults injected, one at a time, for the floor and again for gpuhealth.
    #[arg(long, default_value_t = 100)]
    pub faults: usize,
    /// Time between two injected faults, in milliseconds.
    #[arg(long, default_value_t = 200)]
    pub fault_interval_ms: u64,
    /// Nodes failing at once in the storm.
    #[arg(long, default_value_t = 100)]
    pub storm: usize,
    /// The policy's maxConcurrent during the storm.
    #[arg(long, default_value_t = 20)]
    pub max_concurrent: u32,
    /// How long the quiet cluster is watched, in seconds: two of the
    /// agents' refreshes.
    #[arg(long, default_value_t = 600)]
    pub quiet_secs: u64,
    /// Real agent binaries (fake backend) running during the quiet phase.
    #[arg(long, default_value_t = 3)]
    pub agents: usize,
    /// Their `--refresh`: the agent's shipped default, so that the quiet
    /// figure includes what it costs.
    #[arg(long, default_value = "5m")]
    pub agent_refresh: String,
    /// Pods on the node drained by gpuhealth and by `kubectl drain`.
    #[arg(long, default_value_t = 110)]
    pub drain_pods: usize,
    /// Drains by each, alternated.
    #[arg(long, default_value_t = 3)]
    pub drain_repeats: usize,
    /// Incidents (nodes of the storm, failing at once) under per-GPU
    /// quarantine and again under node-wide, for the capacity each costs.
    #[arg(long, default_value_t = 10)]
    pub capacity_incidents: usize,
    /// Nodes of the training gang, eight ranks on each.
    #[arg(long, default_value_t = 32)]
    pub gang_nodes: usize,
    /// The gang policy's `drain.gangs.notice`, in seconds.
    #[arg(long, default_value_t = 60)]
    pub gang_notice_secs: u64,
    /// How long a rank hangs on a collective before the job's own timeout
    /// fails it: PyTorch's default for NCCL, 10 minutes.
    #[arg(long, default_value_t = 600)]
    pub gang_hang_timeout_secs: u64,
    /// Runs only the training gang's comparison, and writes
    /// `<label>-gangs.json` and `.md`.
    #[arg(long)]
    pub only_gangs: bool,
    /// Where the results go: `<label>.json`, `<label>.md`, plots.
    #[arg(long, default_value = "bench/results")]
    pub out: PathBuf,
    /// The results' file name; today's date by default.
    #[arg(long)]
    pub label: Option<String>,
    /// The peer's checkout (its `recipe/` and `source/`): Medik8s Node
    /// Healthcheck runs beside gpuhealth where it and `--nhc-bin` are given.
    #[arg(long, env = "GPUHEALTH_NHC_DIR")]
    pub nhc_dir: Option<PathBuf>,
    /// The peer's manager binary, as `make peer-nhc` builds it.
    #[arg(long, env = "GPUHEALTH_NHC_BIN")]
    pub nhc_bin: Option<PathBuf>,
    /// Fleet sizes gpuhealth is compared with the peer at, as the fleet
    /// grows (each at most --nodes).
    #[arg(long, value_delimiter = ',', default_value = "100,1000")]
    pub peer_at: Vec<usize>,
    /// Nodes left to each tool in a comparison; faults take them in turn.
    #[arg(long, default_value_t = 20)]
    pub peer_nodes: usize,
    /// Faults on each side, at each size.
    #[arg(long, default_value_t = 100)]
    pub peer_faults: usize,
    /// Time between two faults (one side's, then the other's), in ms.
    #[arg(long, default_value_t = 500)]
    pub peer_interval_ms: u64,
    /// Nodes of each side failing at once in the comparison's storm.
    #[arg(long, default_value_t = 20)]
    pub peer_storm: usize,
    /// How long both are watched at rest, in seconds.
    #[arg(long, default_value_t = 60)]
    pub peer_rest_secs: u64,
    /// Nodes served by a real agent (NVML backend, shipped flags) for the
    /// time from the Xid to the cordon.
    #[arg(long, default_value_t = 4)]
    pub detect_nodes: usize,
    /// Xids written on each path (kernel log, NVML event), the nodes
    /// taking them in turn.
    #[arg(long, default_value_t = 50)]
    pub detect_faults: usize,
    /// The large fleet, after every other phase: nodes with no pods are
    /// added up to this size and a fresh operator is measured there. At
    /// most --nodes leaves the phase out.
    #[arg(long, default_value_t = 10000)]
    pub large: usize,
    /// Sizes of the large fleet, besides `--large`, where its faults are
    /// measured (and its idle memory judged against 64 MiB).
    #[arg(long, value_delimiter = ',', default_value = "5000")]
    pub large_measure_at: Vec<usize>,
    /// The size of the large fleet where the peer is compared with
    /// gpuhealth (at most `--large`).
    #[arg(long, default_value_t = 5000)]
    pub large_peer_at: usize,
    /// Nodes added at a time to the large fleet.
    #[arg(long, default_value_t = 1000)]
    pub large_step: usize,
    /// Faults on each side (floor, gpuhealth) in the large fleet's time to
    /// quarantine.
    #[arg(long, default_value_t = 1000)]
    pub large_faults: usize,
    /// Faults on each side beside the peer in the large fleet: its pass
    /// over every node's Lease grows with the fleet (bench/FINDINGS.md).
    #[arg(long, default_value_t = 20)]
    pub large_peer_faults: usize,
    /// Faults in the large fleet, each coming during the pass over every
    /// node that a change of the policy's spec starts; 0 leaves them out.
    #[arg(long, default_value_t = 20)]
    pub pass_faults: usize,
    /// How long after the policy's change each of those faults comes.
    #[arg(long, default_value_t = 200)]
    pub pass_fault_delay_ms: u64,
    /// Seed for picking the nodes that fail.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

impl Args {
    fn check(&self) -> Result<()> {
        let needed = self.faults * 2 + self.storm + self.agents;
        if needed > self.nodes || self.small > self.nodes || self.small == 0 {
            return Err(format!(
                "{} nodes are too few: the floor's and gpuhealth's faults, the storm and the agents need {needed} distinct nodes, and --small must be from 1 to --nodes",
                self.nodes
            )
            .into());
        }
        if self.large > self.nodes {
            self.check_large()?;
        }
        if self.gang_nodes == 0 {
            return Err("--gang-nodes must be at least 1".into());
        }
        if self.detect_nodes == 0 {
            return Err("--detect-nodes must be at least 1".into());
        }
        if let Some(size) = self.peer_at.iter().find(|&&n| n > self.nodes || n < 2) {
            return Err(format!("--peer-at {size}: each size must be from 2 to --nodes").into());
        }
        Ok(())
    }

    /// The large fleet: each size its faults are measured at is one it
    /// stops at, and holds, besides the nodes failed at the sizes before
    /// it, both sides' faults and the faults during a pass (and two for the
    /// peer, where it runs).
    fn check_large(&self) -> Result<()> {
        if self.large_step == 0 {
            return Err("--large-step must be at least 1".into());
        }
        let sizes = self.large_sizes_measured();
        if let Some(off) = sizes
            .iter()
            .find(|&&n| n < self.large && !(n - self.nodes).is_multiple_of(self.large_step))
        {
            return Err(format!(
                "--large-measure-at {off}: not a size the large fleet stops at (--nodes {} plus steps of --large-step {})",
                self.nodes, self.large_step
            )
            .into());
        }
        let peer_at = self.large_peer_at.min(self.large);
        if !sizes.contains(&peer_at) {
            return Err(format!(
                "--large-peer-at {peer_at}: the peer is compared where the faults are measured: at --large or one of --large-measure-at"
            )
            .into());
        }
        let mut failed = 0;
        for size in sizes {
            let needed =
                2 * self.large_faults + self.pass_faults + 2 * usize::from(size == peer_at);
            let left = size - self.nodes - failed;
            if needed > left {
                return Err(format!(
                    "the large fleet at {size} nodes: {left} of its new nodes are left for {needed} (both sides' {} faults, {} during a pass, two for the peer where it runs)",
                    self.large_faults, self.pass_faults
                )
                .into());
            }
            failed += 2 * self.large_faults + self.pass_faults;
        }
        Ok(())
    }

    /// The sizes of the large fleet where its faults are measured.
    pub fn large_sizes_measured(&self) -> Vec<usize> {
        let mut sizes: Vec<usize> = self
            .large_measure_at
            .iter()
            .copied()
            .filter(|&n| n > self.nodes && n < self.large)
            .collect();
        sizes.push(self.large);
        sizes.sort_unstable();
        sizes.dedup();
        sizes
    }

    pub fn quiet(&self) -> Duration {
        Duration::from_secs(self.quiet_secs)
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(e) = args.check() {
        eprintln!("gpuhealth-bench: {e}");
        return ExitCode::FAILURE;
    }
    if args.only_gangs {
        return match phases::gangs_only(&args).await {
            Ok(written) => {
                for p in written {
                    println!("wrote {}", p.display());
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("gpuhealth-bench: {e}");
                ExitCode::FAILURE
            }
        };
    }
    match phases::run(&args).await {
        Ok(results) => match report::write(&args, &results) {
            Ok(paths) => {
                for p in paths {
                    println!("wrote {}", p.display());
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("gpuhealth-bench: writing the results: {e}");
                ExitCode::FAILURE
            }
        },
        Err(e) => {
            eprintln!("gpuhealth-bench: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::Args;

    /// Flags as the shell splits them.
    fn args(flags: &str) -> Args {
        Args::parse_from(std::iter::once("gpuhealth-bench").chain(flags.split_whitespace()))
    }

    #[test]
    fn the_large_fleets_defaults_and_the_smokes_sizes_hold_their_faults() {
        assert!(args("").check().is_ok(), "{:?}", args("").check());
        // The Makefile's bench-smoke.
        let smoke = args(
            "--nodes 10 --small 4 --faults 2 --storm 3 --agents 1 --peer-at 10 \
             --large 26 --large-step 8 --large-measure-at 18 --large-peer-at 18 \
             --large-faults 2 --pass-faults 2",
        );
        assert!(smoke.check().is_ok(), "{:?}", smoke.check());
        assert_eq!(smoke.large_sizes_measured(), [18, 26]);
    }

    #[test]
    fn a_large_fleet_that_cannot_hold_its_faults_is_refused_not_run() {
        for (flags, says) in [
            (
                "--large-measure-at 1100 --large-step 100 --large-peer-at 10000",
                "at 1100 nodes",
            ),
            (
                "--large-measure-at 5500",
                "not a size the large fleet stops at",
            ),
            ("--large-peer-at 7000", "--large-peer-at 7000"),
        ] {
            let refused = args(flags).check().expect_err("refused").to_string();
            assert!(refused.contains(says), "{flags}: {refused}");
        }
    }
}
