//! gpuhealth-agent: runs on each GPU node (a DaemonSet), reads every GPU's
//! health, publishes the `gpuhealth.io/gpus` report and the `GpuHealthy`
//! condition on its Node, and carries out the reset and reboot requests the
//! operator writes there, each at most once.
//!
//! Backends: `nvml` (real GPUs) and `fake` (simulated nodes: the hardware is
//! the Node's `gpuhealth.io/sim-hardware` annotation). `--once` reads the
//! GPUs, prints the report and exits, touching nothing.
//!
//! With `nvml` the agent also follows the kernel log for Xids, and falls
//! back to the log alone where NVML cannot be loaded (unless
//! `--require-nvml`); it also follows NVML's critical-XID events. It serves
//! `/metrics`, `/livez` and `/readyz`.

use std::{net::SocketAddr, path::PathBuf, process::ExitCode, sync::Arc, time::Duration};

use clap::{Parser, ValueEnum};
use gpuhealth_agent::{
    backend::{FakeBackend, KmsgBackend, NvmlBackend, RebootMethod},
    journal::Journal,
    kmsg::Feed,
    metrics::AgentMetrics,
    node_agent::{CrashPoint, NodeAgent, Settings},
    nvml::{self, NvmlSource},
};
use gpuhealth_api::contract::{AnnotationValue, GpuReport};
use gpuhealth_http::api_requests::CountRequests;
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use tracing::{error, warn};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Backend {
    /// NVML through libnvidia-ml.so.
    Nvml,
    /// The Node's `gpuhealth.io/sim-hardware` annotation, for simulated nodes.
    Fake,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Reboot {
    /// Refuse reboot requests.
    None,
    /// Create kured's sentinel file (--kured-sentinel).
    Kured,
    /// `systemctl reboot` in the host's namespaces.
    Systemd,
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
    /// Where the agent journals the requests it carries out (a hostPath, so
    /// it outlives the pod: no request runs twice).
    #[arg(long, default_value = "/var/lib/gpuhealth-agent")]
    state_dir: PathBuf,
    /// How often to read the GPUs when nothing else happens.
    #[arg(long, default_value = "10s", value_parser = duration)]
    poll: Duration,
    /// How often to refresh the GpuHealthy condition when nothing changes.
    #[arg(long, default_value = "5m", value_parser = duration)]
    heartbeat: Duration,
    /// Requests older than this are refused, not carried out.
    #[arg(long, default_value = "1h", value_parser = duration)]
    request_max_age: Duration,
    /// Where to serve /metrics, /livez and /readyz.
    #[arg(long, env = "GPUHEALTH_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    /// The kernel log to follow for `NVRM: Xid` lines.
    #[arg(long, default_value = "/dev/kmsg")]
    kmsg_path: PathBuf,
    /// Exit when NVML cannot be loaded, rather than fall back to the kernel
    /// log alone.
    #[arg(long)]
    require_nvml: bool,
    /// The kubelet PodResources socket, to say which pod holds which GPU.
    #[arg(long, default_value = "/var/lib/kubelet/pod-resources/kubelet.sock")]
    pod_resources_socket: PathBuf,
    /// How the nvml backend reboots the node.
    #[arg(long, value_enum, default_value_t = Reboot::None)]
    reboot_method: Reboot,
    /// kured's sentinel file, for --reboot-method kured.
    #[arg(long, default_value = "/var/run/reboot-required")]
    kured_sentinel: PathBuf,
    /// Read every GPU once, print the `gpuhealth.io/gpus` report as JSON on
    /// stdout and exit: a check of the backend on a node, touching nothing.
    #[arg(long)]
    once: bool,
    /// With --once: print what NVML said for each GPU instead of the report.
    #[arg(long, requires = "once")]
    readings: bool,
}

fn duration(s: &str) -> Result<Duration, String> {
    s.parse::<gpuhealth_api::Duration>()
        .map(|d| d.as_std())
        .map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.once {
        return match args.backend {
            Backend::Nvml => once_nvml(args.readings),
            Backend::Fake => {
                eprintln!("gpuhealth-agent: --once reads NVML; the fake backend lives on its Node");
                ExitCode::from(2)
            }
        };
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube=warn")),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("gpuhealth-agent: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(serve(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!(error = %e, "gpuhealth-agent stopped");
            ExitCode::FAILURE
        }
    }
}

async fn serve(args: Args) -> Result<(), String> {
    let node = args.node_name.clone().ok_or("--node-name is required")?;
    let crash_after = match std::env::var("GPUHEALTH_TEST_CRASH_AFTER").as_deref() {
        Ok("begun") => Some(CrashPoint::Begun),
        Ok("finished") => Some(CrashPoint::Finished),
        Ok(other) => return Err(format!("GPUHEALTH_TEST_CRASH_AFTER: no point {other}")),
        Err(_) => None,
    };
    let journal = Journal::open(&args.state_dir).map_err(|e| e.to_string())?;
    let metrics = Arc::new(AgentMetrics::default());
    let listener = tokio::net::TcpListener::bind(args.metrics_addr)
        .await
        .map_err(|e| format!("serving metrics on {}: {e}", args.metrics_addr))?;
    let served = metrics.clone();
    tokio::spawn(async move {
        if let Err(e) = gpuhealth_http::serve(listener, served).await {
            error!(error = %e, "the metrics endpoint stopped");
        }
    });
    let config = kube::Config::infer().await.map_err(|e| e.to_string())?;
    let client = kube::client::ClientBuilder::try_from(config)
        .map_err(|e| e.to_string())?
        .with_layer(&CountRequests(metrics.api_requests.clone()))
        .build();
    let settings = Settings {
        node,
        poll: args.poll,
        heartbeat: args.heartbeat,
        request_max_age: args.request_max_age,
        crash_after,
    };
    match args.backend {
        Backend::Fake => {
            let backend = FakeBackend {
                client: client.clone(),
                xids: metrics.xids.clone(),
                seen: Default::default(),
            };
            until_stopped(NodeAgent::new(client, settings, backend, journal).with_metrics(metrics))
                .await;
        }
        Backend::Nvml => {
            let reboot_method = match args.reboot_method {
                Reboot::None => RebootMethod::None,
                Reboot::Kured => RebootMethod::Kured(args.kured_sentinel.clone()),
                Reboot::Systemd => RebootMethod::Systemd,
            };
            let feed = Feed::new(metrics.xids.clone());
            let following = match feed.follow(args.kmsg_path.clone()) {
                Ok(()) => true,
                Err(e) => {
                    warn!(path = %args.kmsg_path.display(), error = %e, "cannot follow the kernel log: Xids from before NVML's events are missed");
                    false
                }
            };
            let wake = feed.wake.clone();
            match NvmlSource::init() {
                Ok(source) => {
                    let events = feed.clone();
                    if let Err(e) = nvml::watch_xids(move |pci, code| events.nvml_xid(pci, code)) {
                        warn!(error = %e, "NVML's XID events are not available; the kernel log carries the Xids");
                    }
                    let backend = NvmlBackend {
                        source,
                        kernel_log: Some(feed),
                        pod_resources: args.pod_resources_socket.clone(),
                        reboot_method,
                        nvidia_smi: PathBuf::from("nvidia-smi"),
                    };
                    until_stopped(
                        NodeAgent::new(client, settings, backend, journal)
                            .with_metrics(metrics)
                            .woken_by(wake),
                    )
                    .await;
                }
                Err(e) if args.require_nvml => return Err(e.to_string()),
                Err(e) if following => {
                    warn!(error = %e, "falling back to the kernel log alone: GPUs are known by what the driver logged, and resets are refused");
                    let backend = KmsgBackend {
                        kernel_log: feed,
                        reboot_method,
                    };
                    until_stopped(
                        NodeAgent::new(client, settings, backend, journal)
                            .with_metrics(metrics)
                            .woken_by(wake),
                    )
                    .await;
                }
                Err(e) => {
                    return Err(format!("{e}; and the kernel log cannot be read either"));
                }
            }
        }
    }
    Ok(())
}

/// Runs the agent until Ctrl-C. (On SIGTERM the process just ends: the
/// journal makes that safe at any moment.)
async fn until_stopped<B: gpuhealth_agent::backend::Backend>(agent: NodeAgent<B>) {
    tokio::select! {
        () = agent.run() => {}
        _ = tokio::signal::ctrl_c() => {}
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
