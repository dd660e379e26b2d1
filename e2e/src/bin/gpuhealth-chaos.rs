//! gpuhealth-chaos: `make chaos`. Runs the reliability scenarios of
//! `docs/reliability.md` on the local test cluster (or the one in
//! `GPUHEALTH_E2E_KUBECONFIG`) and prints, per scenario, the trials, the
//! faults injected, the invariant violations found and how the sick nodes
//! ended. Exits non-zero on any violation.

use std::{path::PathBuf, process::ExitCode};

use clap::Parser;
use gpuhealth_e2e::chaos::{self, Rng, Row};

#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// Trials of SIGKILLing the leader mid-remediation.
    #[arg(long, default_value_t = 50)]
    kill_trials: usize,
    /// Trials in which the leader exits between an incident's fence and
    /// its status (each: once with the cordon, once with a GPU's rule).
    #[arg(long, default_value_t = 3)]
    fence_kill_trials: usize,
    /// Restarts of the API server and etcd (alternately) mid-remediation.
    #[arg(long, default_value_t = 10)]
    restart_trials: usize,
    /// Trials cutting the leader off the API server mid-remediation.
    #[arg(long, default_value_t = 5)]
    fencing_trials: usize,
    /// Trials cutting the leader off the API server mid-remediation with a
    /// partition that delivers what it sent after the standby has acted.
    #[arg(long, default_value_t = 5)]
    late_partition_trials: usize,
    /// Trials SIGKILLing the leader mid-remediation with a standby whose
    /// watches lag behind.
    #[arg(long, default_value_t = 5)]
    lag_trials: usize,
    /// Trials with another writer replacing the same nodes and pods.
    #[arg(long, default_value_t = 10)]
    conflict_trials: usize,
    /// Trials with a hostile producer writing gpuhealth's annotations.
    #[arg(long, default_value_t = 5)]
    hostile_trials: usize,
    /// Storms of 30% of the nodes failing at once, for each limit that
    /// must hold (the breaker; maxConcurrent).
    #[arg(long, default_value_t = 5)]
    storm_trials: usize,
    /// Trials in which a pod comes to hold a GPU after it was judged bad:
    /// allocated before its rule existed, and while its rule was deleted
    /// mid-incident, in turn.
    #[arg(long, default_value_t = 6)]
    newcomer_trials: usize,
    /// The operator binary the newcomer trials run (by default this
    /// build's): an older build shows what the checker catches.
    #[arg(long)]
    newcomer_operator: Option<PathBuf>,
    /// Trials upgrading the replicas from the previous release to this
    /// build mid-remediation.
    #[arg(long, default_value_t = 8)]
    upgrade_trials: usize,
    /// The previous release's operator binary (`make previous-release`).
    #[arg(long, default_value = "target/previous/debug/gpuhealth-operator")]
    previous_operator: PathBuf,
    /// The random seed; by default the time. Printed, so that a run can be
    /// repeated.
    #[arg(long)]
    seed: Option<u64>,
    /// Where to write the table (Markdown) besides printing it.
    #[arg(long)]
    out: Option<PathBuf>,
}

/// Keeps a scenario's row, or says why it could not run.
fn collect(
    rows: &mut Vec<Row>,
    failed: &mut bool,
    scenario: &str,
    result: gpuhealth_e2e::Result<Row>,
) {
    match result {
        Ok(row) => rows.push(row),
        Err(e) => {
            eprintln!("chaos: {scenario} could not run: {e}");
            *failed = true;
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    eprintln!("chaos: seed {seed} (repeat with --seed {seed})");
    let mut rng = Rng::new(seed);
    let started = std::time::Instant::now();
    let mut rows: Vec<Row> = Vec::new();
    let mut failed = false;
    if args.kill_trials > 0 {
        collect(
            &mut rows,
            &mut failed,
            "operator SIGKILL",
            chaos::kill::run(args.kill_trials, &mut rng).await,
        );
    }
    if args.fence_kill_trials > 0 {
        collect(
            &mut rows,
            &mut failed,
            "kill between fence and status",
            chaos::fence_kills::run(args.fence_kill_trials, &mut rng).await,
        );
    }
    if args.restart_trials > 0 {
        collect(
            &mut rows,
            &mut failed,
            "restarts",
            chaos::restarts::run(args.restart_trials, &mut rng).await,
        );
    }
    if args.fencing_trials > 0 {
        collect(
            &mut rows,
            &mut failed,
            "fencing",
            chaos::fencing::run(
                args.fencing_trials,
                chaos::fencing::Partition::Drops,
                &mut rng,
            )
            .await,
        );
    }
    if args.late_partition_trials > 0 {
        collect(
            &mut rows,
            &mut failed,
            "late partition",
            chaos::fencing::run(
                args.late_partition_trials,
                chaos::fencing::Partition::DeliversLate,
                &mut rng,
            )
            .await,
        );
    }
    if args.lag_trials > 0 {
        collect(
            &mut rows,
            &mut failed,
            "watch lag",
            chaos::lag::run(args.lag_trials, &mut rng).await,
        );
    }
    if args.conflict_trials > 0 {
        collect(
            &mut rows,
            &mut failed,
            "conflicts",
            chaos::conflicts::run(args.conflict_trials, &mut rng).await,
        );
    }
    if args.hostile_trials > 0 {
        collect(
            &mut rows,
            &mut failed,
            "hostile input",
            chaos::hostile::run(args.hostile_trials, &mut rng).await,
        );
    }
    if args.newcomer_trials > 0 {
        collect(
            &mut rows,
            &mut failed,
            "newcomers",
            chaos::newcomers::run(
                args.newcomer_trials,
                args.newcomer_operator.as_deref(),
                &mut rng,
            )
            .await,
        );
    }
    if args.upgrade_trials > 0 {
        collect(
            &mut rows,
            &mut failed,
            "upgrade mid-remediation",
            chaos::upgrade::run(args.upgrade_trials, &args.previous_operator, &mut rng).await,
        );
    }
    if args.storm_trials > 0 {
        for limit in [
            chaos::storm::Limit::Breaker,
            chaos::storm::Limit::MaxConcurrent,
        ] {
            collect(
                &mut rows,
                &mut failed,
                "storm",
                chaos::storm::run(args.storm_trials, limit, &mut rng).await,
            );
        }
    }
    let table = chaos::table(&rows);
    println!("{table}");
    eprintln!("chaos: done in {:.0} s", started.elapsed().as_secs_f64());
    for row in &rows {
        for v in &row.violations {
            eprintln!("chaos: {}: {v:?}", row.scenario);
        }
        failed |= !row.violations.is_empty();
    }
    if let Some(path) = &args.out {
        let text = format!("Seed {seed}.\n\n{table}");
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("chaos: writing {}: {e}", path.display());
            failed = true;
        }
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
