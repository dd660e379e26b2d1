//! kubectl-gpuhealth: the kubectl plugin (`kubectl gpuhealth ...`).
//!
//! Built: `pods-on-gpu`. The other subcommands come with the issue that
//! builds their data; until then each says so and exits non-zero.

mod pods_on_gpu;

use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use gpuhealth_api::contract::{AnnotationValue, GPU_REPORT_ANNOTATION, GpuReport};
use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client, ResourceExt};

/// Inspect gpuhealth: the fleet, a node's timeline, a workload's probes.
#[derive(Debug, Parser)]
#[command(name = "kubectl-gpuhealth", version, about, long_about = None)]
struct Args {
    /// Output format.
    #[arg(short, long, global = true, value_enum, default_value_t = Output::Text)]
    output: Output,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Output {
    Text,
    Json,
    Yaml,
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
    /// The pods holding a GPU of a node, from the agent's report.
    PodsOnGpu {
        node: String,
        /// GPU UUID, index, or PCI bus id.
        gpu: String,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    let result = match &args.command {
        Command::PodsOnGpu { node, gpu } => pods_on_gpu(node, gpu, args.output).await,
        other => Err(format!("{other:?} is not implemented yet")),
    };
    match result {
        Ok(out) => {
            print!("{out}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kubectl-gpuhealth: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn pods_on_gpu(node: &str, gpu: &str, output: Output) -> Result<String, String> {
    let client = Client::try_default()
        .await
        .map_err(|e| format!("connecting to the cluster: {e}"))?;
    let n = Api::<Node>::all(client)
        .get(node)
        .await
        .map_err(|e| format!("node {node}: {e}"))?;
    let raw = n.annotations().get(GPU_REPORT_ANNOTATION).ok_or_else(|| {
        format!(
            "node {node} has no {GPU_REPORT_ANNOTATION} report: is gpuhealth-agent running there?"
        )
    })?;
    let report = GpuReport::parse(raw).map_err(|e| format!("node {node}: {e}"))?;
    let entry = pods_on_gpu::find(&report, gpu)?;
    let answer = pods_on_gpu::Answer { node, gpu: entry };
    match output {
        Output::Text => Ok(pods_on_gpu::text(node, entry)),
        Output::Json => serde_json::to_string_pretty(&answer)
            .map(|s| s + "\n")
            .map_err(|e| e.to_string()),
        Output::Yaml => serde_yaml::to_string(&answer).map_err(|e| e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn flags_are_consistent() {
        super::Args::command().debug_assert();
    }
}
