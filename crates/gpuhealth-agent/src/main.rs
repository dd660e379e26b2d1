//! gpuhealth-agent: runs on each GPU node (a DaemonSet), reads every GPU's
//! health, publishes the `gpuhealth.io/gpus` report and carries out the reset
//! and reboot requests the operator writes on its Node.
//!
//! Built so far: the kernel-log parser (`gpuhealth_agent::kmsg`) and the
//! NVML reader (`gpuhealth_agent::nvml`), which `--once` runs: read every
//! GPU, print the report, exit. The loop that publishes the report on the
//! Node and carries out requests is not built yet; without `--once` the
//! agent says so and exits non-zero.

use std::{path::PathBuf, process::ExitCode};

use clap::{Parser, ValueEnum};
use gpuhealth_agent::nvml::{self, NvmlSource};
use gpuhealth_api::contract::{AnnotationValue, GpuReport};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Backend {
    /// NVML through libnvidia-ml.so, plus the kernel log.
    Nvml,
    /// The kernel log only (`/dev/kmsg` or a file).
    Kmsg,
    /// A scenario file, for simulated nodes.
    Fake,
}

/// The gpuhealth node agent.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Args {
    /// The Node this agent runs on (from the downward API).
    #[arg(long, env = "NODE_NAME", required_unless_present = "once")]
    node_name: Option<String>,
    /// Where GPU health comes from.
    #[arg(long, value_enum, default_value_t = Backend::Nvml)]
    backend: Backend,
    /// Kernel log to follow for `NVRM: Xid` lines.
    #[arg(long, default_value = "/dev/kmsg")]
    kmsg_path: PathBuf,
    /// Scenario for the fake backend.
    #[arg(long, required_if_eq("backend", "fake"))]
    scenario: Option<PathBuf>,
    /// The kubelet PodResources socket, to map GPUs to pods.
    #[arg(long, default_value = "/var/lib/kubelet/pod-resources/kubelet.sock")]
    pod_resources_socket: PathBuf,
    /// Read every GPU once, print the `gpuhealth.io/gpus` report as JSON on
    /// stdout and exit: a check of the backend on a node, touching nothing.
    #[arg(long)]
    once: bool,
    /// With --once: print what NVML said for each GPU instead of the report.
    #[arg(long, requires = "once")]
    readings: bool,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if !args.once {
        eprintln!("gpuhealth-agent {}: {args:?}", env!("CARGO_PKG_VERSION"));
        eprintln!(
            "gpuhealth-agent: publishing reports and carrying out requests is not implemented yet; --once reads the GPUs and prints the report"
        );
        return ExitCode::from(2);
    }
    match args.backend {
        Backend::Nvml => once_nvml(args.readings),
        other => {
            eprintln!("gpuhealth-agent: --once reads NVML only so far, not {other:?}");
            ExitCode::from(2)
        }
    }
}

fn once_nvml(readings: bool) -> ExitCode {
    let source = match NvmlSource::init() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("gpuhealth-agent: {e}");
            return ExitCode::FAILURE;
        }
    };
    let observed = match source.read() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("gpuhealth-agent: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(v) = source.driver_version() {
        eprintln!(
            "gpuhealth-agent: NVIDIA driver {v}, {} GPU(s)",
            observed.len()
        );
    }
    let out = if readings {
        serde_json::to_string_pretty(&observed)
    } else {
        let report = GpuReport {
            version: GpuReport::VERSION,
            observed_at: Time(Timestamp::now()),
            source: Some("gpuhealth-agent/nvml".into()),
            gpus: observed.iter().map(nvml::entry).collect(),
        };
        // The operator refuses a report that breaks the contract: say so here too.
        if let Err(e) = report.check() {
            eprintln!("gpuhealth-agent: this report would be refused: {e}");
        }
        serde_json::to_string_pretty(&report)
    };
    match out {
        Ok(json) => {
            println!("{json}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("gpuhealth-agent: {e}");
            ExitCode::FAILURE
        }
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
