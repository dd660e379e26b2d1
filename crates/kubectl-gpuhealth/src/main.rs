//! kubectl-gpuhealth: the kubectl plugin (`kubectl gpuhealth ...`).
//!
//! The subcommands are declared; each comes with the issue that builds its
//! data. Until then a subcommand says so and exits non-zero.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Inspect gpuhealth: the fleet, a node's timeline, a workload's probes.
#[derive(Debug, Parser)]
#[command(name = "kubectl-gpuhealth", version, about, long_about = None)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Policies and node health at a glance.
    Status,
    /// A node's timeline: signals, decisions, actions, outcome.
    Explain {
        /// The node.
        node: String,
    },
    /// Compare a workload's startup probe window with its observed cold start.
    ProbeCheck {
        /// `namespace/pod` or `namespace/deployment/name`.
        target: String,
    },
    /// The pods holding a GPU of a node.
    Pods {
        node: String,
        /// GPU UUID or PCI bus id.
        gpu: String,
    },
}

fn main() -> ExitCode {
    let args = Args::parse();
    eprintln!(
        "kubectl-gpuhealth: {:?} is not implemented yet",
        args.command
    );
    ExitCode::from(2)
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn flags_are_consistent() {
        super::Args::command().debug_assert();
    }
}
