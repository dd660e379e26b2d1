//! gpuhealth-operator: watches the nodes that `GpuHealthPolicy` objects
//! select and takes each unhealthy one from first signal back to serving.
//!
//! This binary parses its flags; the controllers come with the remediation
//! work (see the README's roadmap). Until then it says so and exits non-zero.

use std::{net::SocketAddr, process::ExitCode};

use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// The gpuhealth operator.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Args {
    /// Address for Prometheus metrics (`/metrics`).
    #[arg(long, env = "GPUHEALTH_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    /// Address for liveness and readiness probes (`/healthz`, `/readyz`).
    #[arg(long, env = "GPUHEALTH_HEALTH_ADDR", default_value = "0.0.0.0:8081")]
    health_addr: SocketAddr,
    /// Take a coordination.k8s.io Lease so that only one replica acts.
    #[arg(long, env = "GPUHEALTH_LEADER_ELECTION", default_value_t = true, action = clap::ArgAction::Set)]
    leader_election: bool,
    /// Namespace of the leader-election Lease.
    #[arg(long, env = "POD_NAMESPACE", default_value = "gpuhealth-system")]
    namespace: String,
    /// Log format.
    #[arg(long, env = "GPUHEALTH_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

fn main() -> ExitCode {
    let args = Args::parse();
    eprintln!("gpuhealth-operator {}: {args:?}", env!("CARGO_PKG_VERSION"));
    eprintln!("gpuhealth-operator: the controllers are not implemented yet; nothing to run");
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
