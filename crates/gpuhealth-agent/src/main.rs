//! gpuhealth-agent: runs on each GPU node (a DaemonSet), reads every GPU's
//! health, publishes the `gpuhealth.io/gpus` report and carries out the reset
//! and reboot requests the operator writes on its Node.
//!
//! This binary parses its flags; of the backends only the kernel-log parser
//! (`gpuhealth_agent::kmsg`) is built so far. Until the rest are, it says so
//! and exits non-zero.

use std::{path::PathBuf, process::ExitCode};

use clap::{Parser, ValueEnum};

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
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
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
}

fn main() -> ExitCode {
    let args = Args::parse();
    eprintln!("gpuhealth-agent {}: {args:?}", env!("CARGO_PKG_VERSION"));
    eprintln!("gpuhealth-agent: the GPU backends are not implemented yet; nothing to run");
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
