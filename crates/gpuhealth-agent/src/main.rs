//! gpuhealth-agent: runs on each GPU node (a DaemonSet), reads every GPU's
//! health, publishes the `gpuhealth.io/gpus` report and the `GpuHealthy`
//! condition on its Node, and carries out the reset, reboot and DCGM
//! diagnostics requests the operator writes there, each at most once. `--role` chooses the part: the
//! reporter (reads and publishes), the executor (carries out), or both in
//! one process; shipped, each part runs in a DaemonSet of its own with only
//! its own privileges.
//!
//! Backends: `nvml` (real GPUs: NVML, the kernel log and NVML's XID events,
//! the kubelet's PodResources), `kmsg` (the kernel log alone, chosen by
//! hand: no resets), and `fake` (simulated nodes: the hardware is the Node's
//! `gpuhealth.io/sim-hardware` annotation). With `nvml`, GPUs that cannot be
//! read are said so in the report, the `GpuHealthy` condition (`Unknown`)
//! and `/readyz`; the agent keeps trying. `--once` reads the GPUs, prints
//! the report and exits, touching nothing. It serves `/metrics`, `/livez`
//! and `/readyz`.

use std::{
    ffi::OsString, net::SocketAddr, path::PathBuf, process::ExitCode, sync::Arc, time::Duration,
};

use clap::{Parser, ValueEnum};
use gpuhealth_agent::{
    capability_checks::{CapabilityChecks, ResetNeeds},
    diagnostics::Dcgm,
    driver_root::DriverRoot,
    fake::FakeBackend,
    handoff::Handoff,
    journal::Journal,
    kmsg::Feed,
    metrics::AgentMetrics,
    node_agent::{CrashPoint, NodeAgent, Role, Settings},
    nvidia_smi::NvidiaSmi,
    nvml::{self, NVML_LIBRARY},
    nvml_backend::{KmsgBackend, NvmlBackend},
    nvml_thread::{NvmlLibrary, NvmlThread, XidNews},
    operands::{DEFAULT_OPERANDS, Operands},
    reboot::{RebootMethod, SYSTEM_BUS},
    recoveries::Recoveries,
    reset::ResetSettings,
};
use gpuhealth_api::contract::{AnnotationValue, Capabilities, GpuReport};
use gpuhealth_http::api_requests::CountRequests;
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use tracing::{error, info, warn};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Backend {
    /// NVML through libnvidia-ml.so.1, with the kernel log.
    Nvml,
    /// The kernel log alone: GPUs as the driver logged them; no resets.
    Kmsg,
    /// The Node's `gpuhealth.io/sim-hardware` annotation, for simulated nodes.
    Fake,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Reboot {
    /// Refuse reboot requests.
    None,
    /// Create kured's sentinel file (--kured-sentinel).
    Kured,
    /// Ask systemd-logind over the system D-Bus (--system-bus; needs the
    /// host's socket and CAP_SYS_BOOT).
    Logind,
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
    /// Which part this process is: the reporter reads the GPUs and writes
    /// the report, the executor carries out the operator's requests.
    #[arg(long, value_enum, default_value_t = Role::Both)]
    role: Role,
    /// Where this part keeps its state (a hostPath, so it outlives the
    /// pod): the executor journals the requests it carries out (none runs
    /// twice), the reporter the GPUs' recoveries (no answered Xid acts
    /// again).
    #[arg(
        long,
        env = "GPUHEALTH_STATE_DIR",
        default_value = "/var/lib/gpuhealth-agent"
    )]
    state_dir: PathBuf,
    /// The executor's state directory, which the reporter reads (what the
    /// executor can carry out, a reset's call to let go of the GPUs, its
    /// resets); the state directory where not given.
    #[arg(long, env = "GPUHEALTH_EXECUTOR_STATE_DIR")]
    executor_state_dir: Option<PathBuf>,
    /// How often to read the GPUs when nothing else happens.
    #[arg(long, default_value = "10s", value_parser = duration)]
    poll: Duration,
    /// How often to write the report and the GpuHealthy condition when
    /// nothing changes (two writes each time), so that the operator can tell
    /// a live report from a stale one.
    #[arg(long, default_value = "5m", value_parser = duration)]
    refresh: Duration,
    /// Requests older than this are refused, not carried out.
    #[arg(long, default_value = "1h", value_parser = duration)]
    request_max_age: Duration,
    /// Where to serve /metrics, /livez and /readyz.
    #[arg(long, env = "GPUHEALTH_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    /// The kernel log to follow for `NVRM: Xid` lines.
    #[arg(long, env = "GPUHEALTH_KMSG_PATH", default_value = "/dev/kmsg")]
    kmsg_path: PathBuf,
    /// NVML: a file name is looked up on the library path (where the
    /// NVIDIA runtime put it).
    #[arg(long, env = "GPUHEALTH_NVML_LIBRARY", default_value = NVML_LIBRARY, conflicts_with = "driver_root")]
    nvml_library: OsString,
    /// A driver root mounted from the host (the GPU Operator's driver
    /// container's /run/nvidia/driver, or the host's /): NVML loaded from
    /// it by path, and its nvidia-smi run with its own loader and
    /// libraries, never mixed with the image's.
    #[arg(long, env = "GPUHEALTH_DRIVER_ROOT")]
    driver_root: Option<PathBuf>,
    /// How long an NVML call may take before the agent says NVML is hung.
    #[arg(long, default_value = "30s", value_parser = duration)]
    nvml_deadline: Duration,
    /// nvidia-smi, for resets: a file name is looked up on PATH.
    #[arg(
        long,
        env = "GPUHEALTH_NVIDIA_SMI",
        default_value = "nvidia-smi",
        conflicts_with = "driver_root"
    )]
    nvidia_smi: PathBuf,
    /// How long `nvidia-smi --gpu-reset` may take before it is stopped.
    #[arg(long, default_value = "2m", value_parser = duration)]
    reset_timeout: Duration,
    /// How long the GPU's other holders get to let go (the paused operands'
    /// pods to leave) before a reset is refused, naming them.
    #[arg(long, default_value = "2m", value_parser = duration)]
    let_go: Duration,
    /// How long the kubelet gets to offer a reset GPU again.
    #[arg(long, default_value = "5m", value_parser = duration)]
    back_in_service: Duration,
    /// The GPU Operator's operand labels to pause during a reset (those set
    /// to `true` on the node); none to pause nothing.
    #[arg(long, value_delimiter = ',', default_values_t = DEFAULT_OPERANDS.map(String::from))]
    pause_operands: Vec<String>,
    /// Holders of a GPU the driver lets a reset through (by command name);
    /// none by default. (nvidia-persistenced is not one: the reset turns
    /// persistence mode off, and persistenced lets go.)
    #[arg(long, value_delimiter = ',')]
    tolerated_holders: Vec<String>,
    /// The GPUs' device nodes (`nvidia0`, ...).
    #[arg(long, env = "GPUHEALTH_DEV_DIR", default_value = "/dev")]
    dev_dir: PathBuf,
    /// The node's processes (the host's, with `hostPID`), to find who holds a GPU.
    #[arg(long, env = "GPUHEALTH_PROC_DIR", default_value = "/proc")]
    proc_dir: PathBuf,
    /// The kubelet PodResources socket, to say which pod holds which GPU.
    #[arg(
        long,
        env = "GPUHEALTH_POD_RESOURCES_SOCKET",
        default_value = "/var/lib/kubelet/pod-resources/kubelet.sock"
    )]
    pod_resources_socket: PathBuf,
    /// How long the kubelet's PodResources gets to answer.
    #[arg(long, default_value = "10s", value_parser = duration)]
    pod_resources_deadline: Duration,
    /// How the agent reboots the node.
    #[arg(long, value_enum, default_value_t = Reboot::Logind)]
    reboot_method: Reboot,
    /// dcgmi, for DCGM diagnostics: a file name is looked up on PATH.
    #[arg(long, env = "GPUHEALTH_DCGMI", default_value = "/usr/bin/dcgmi")]
    dcgmi: PathBuf,
    /// DCGM's host engine, for dcgmi's --host; dcgmi's default (localhost)
    /// where not given. The GPU Operator's nv-hostengine listens on the
    /// node's port 5555: give `$(HOST_IP):5555` from the downward API, never
    /// a Service, which could reach another node's GPUs.
    #[arg(long, env = "GPUHEALTH_DCGM_HOST")]
    dcgm_host: Option<String>,
    /// The system bus's D-Bus address, for --reboot-method logind.
    #[arg(long, env = "DBUS_SYSTEM_BUS_ADDRESS", default_value = SYSTEM_BUS)]
    system_bus: String,
    /// kured's sentinel file, for --reboot-method kured.
    #[arg(long, default_value = "/var/run/reboot-required")]
    kured_sentinel: PathBuf,
    /// Read every GPU once, print the `gpuhealth.io/gpus` report as JSON on
    /// stdout (with the capabilities checked here, and on stderr why any is
    /// withheld) and exit: a check of the backend on a node, touching
    /// nothing.
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

/// Where NVML and nvidia-smi come from: a driver root (looked in afresh
/// each time, so that a root still being laid out is reported as
/// unreadable and then read, never a crash), or the library path and PATH.
fn driver(args: &Args) -> (NvmlLibrary, NvidiaSmi) {
    match &args.driver_root {
        Some(root) => {
            let root = DriverRoot::new(root.clone());
            (
                NvmlLibrary::InDriverRoot(root.clone()),
                NvidiaSmi::InDriverRoot(root),
            )
        }
        None => (
            NvmlLibrary::Named(args.nvml_library.clone()),
            NvidiaSmi::Program(args.nvidia_smi.clone()),
        ),
    }
}

fn reboot_method(args: &Args) -> RebootMethod {
    match args.reboot_method {
        Reboot::None => RebootMethod::None,
        Reboot::Kured => RebootMethod::Kured(args.kured_sentinel.clone()),
        Reboot::Logind => RebootMethod::Logind(args.system_bus.clone()),
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.once {
        return match args.backend {
            Backend::Nvml => {
                let (library, smi) = driver(&args);
                let reboot = reboot_method(&args);
                once_nvml(&library, &smi, &args.proc_dir, &reboot, args.readings)
            }
            Backend::Kmsg | Backend::Fake => {
                eprintln!("gpuhealth-agent: --once reads NVML");
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
    let role = args.role;
    let executor_dir = args
        .executor_state_dir
        .clone()
        .unwrap_or_else(|| args.state_dir.clone());
    let handoff = Handoff::new(&executor_dir);
    let journal = if role.executes() {
        handoff.executor_started()?;
        Some(Journal::open(&args.state_dir).map_err(|e| e.to_string())?)
    } else {
        None
    };
    let metrics = Arc::new(AgentMetrics::default());
    if !role.reports() {
        // Ready to carry out requests once its journal is open; reading
        // the GPUs, which readiness otherwise follows, is the reporter's.
        metrics.set_readiness(Ok(()));
    }
    // A round of the loop reads NVML and the kubelet, each with a deadline.
    metrics.set_stall_after(
        (args.poll * 3)
            .max(args.nvml_deadline + args.pod_resources_deadline + Duration::from_secs(60)),
    );
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
        role,
        poll: args.poll,
        refresh: args.refresh,
        request_max_age: args.request_max_age,
        crash_after,
        dcgm: Dcgm {
            dcgmi: args.dcgmi.clone(),
            host: args.dcgm_host.clone(),
        },
    };
    let reboot = reboot_method(&args);
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
        Backend::Kmsg => {
            let feed = Feed::new(metrics.xids.clone(), metrics.not_the_drivers.clone());
            if role.reports() {
                let how = feed
                    .follow(args.kmsg_path.clone())
                    .map_err(|e| format!("following {}: {e}", args.kmsg_path.display()))?;
                info!(through = how, "following the kernel log");
            }
            let wake = feed.wake.clone();
            let backend = KmsgBackend::new(feed, reboot, handoff);
            until_stopped(
                NodeAgent::new(client, settings, backend, journal)
                    .with_metrics(metrics)
                    .woken_by(wake),
            )
            .await;
        }
        Backend::Nvml => {
            let (nvml_library, nvidia_smi) = driver(&args);
            let feed = Feed::new(metrics.xids.clone(), metrics.not_the_drivers.clone());
            if role.reports() {
                match feed.follow(args.kmsg_path.clone()) {
                    Ok(how) => info!(through = how, "following the kernel log"),
                    Err(e) => {
                        warn!(path = %args.kmsg_path.display(), error = %e, "cannot follow the kernel log: Xids from before NVML's events are missed")
                    }
                }
                // A reset's call to let go of the GPUs is answered within a
                // second, not at the next poll.
                let (handoff, wake) = (handoff.clone(), feed.wake.clone());
                tokio::spawn(async move {
                    let mut asked = false;
                    loop {
                        tokio::time::sleep(Duration::from_millis(500)).await;
                        if handoff.asked_to_let_go() != asked {
                            asked = !asked;
                            wake.notify_one();
                        }
                    }
                });
            }
            let wake = feed.wake.clone();
            let events = feed.clone();
            let gpus =
                NvmlThread::start(nvml_library, args.nvml_deadline, move |news| match news {
                    XidNews::Listening => events.nvml_listening(true),
                    XidNews::Deaf => events.nvml_listening(false),
                    XidNews::Xid { pci_bus_id, code } => events.nvml_xid(pci_bus_id, code),
                });
            // The reporter's record starts from the one-process agent's,
            // kept where the executor's state now is.
            let seed = (executor_dir != args.state_dir).then_some(executor_dir.as_path());
            let recoveries = Recoveries::open(&args.state_dir, seed)?;
            let reset = ResetSettings {
                nvidia_smi,
                dev_dir: args.dev_dir.clone(),
                proc_dir: args.proc_dir.clone(),
                timeout: args.reset_timeout,
                let_go: args.let_go,
                back_in_service: args.back_in_service,
                tolerated: args.tolerated_holders.clone(),
                operands: Operands::new(args.pause_operands.clone(), &args.state_dir),
                handoff: handoff.clone(),
            };
            let backend = NvmlBackend::new(
                gpus,
                client.clone(),
                Some(feed),
                args.pod_resources_socket.clone(),
                args.pod_resources_deadline,
                reset,
                reboot,
                recoveries,
                handoff,
            );
            until_stopped(
                NodeAgent::new(client, settings, backend, journal)
                    .with_metrics(metrics)
                    .woken_by(wake),
            )
            .await;
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

/// What this agent could carry out here, checked as the running agent
/// checks it (NVML has just answered).
fn checked_capabilities(
    smi: &NvidiaSmi,
    proc: &std::path::Path,
    reboot: &RebootMethod,
) -> Option<Capabilities> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .ok()?;
    let mut checks = CapabilityChecks::default();
    let reset = ResetNeeds {
        nvidia_smi: smi,
        proc,
    };
    runtime.block_on(checks.refresh(Some(reset), reboot));
    for why in checks.withheld() {
        eprintln!("gpuhealth-agent: {why}");
    }
    Some(checks.published(true, reboot))
}

fn once_nvml(
    library: &NvmlLibrary,
    smi: &NvidiaSmi,
    proc: &std::path::Path,
    reboot: &RebootMethod,
    readings: bool,
) -> ExitCode {
    let observed = match library.open().and_then(|n| {
        if let Ok(v) = n.sys_driver_version() {
            eprintln!("gpuhealth-agent: NVIDIA driver {v}");
        }
        nvml::read_all(&n)
    }) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("gpuhealth-agent: {e}");
            return ExitCode::FAILURE;
        }
    };
    eprintln!("gpuhealth-agent: {} GPU(s)", observed.len());
    let out = if readings {
        serde_json::to_string_pretty(&observed)
    } else {
        let report = GpuReport {
            version: GpuReport::VERSION,
            observed_at: Time(Timestamp::now()),
            source: Some("gpuhealth-agent/nvml".into()),
            capabilities: checked_capabilities(smi, proc, reboot),
            unreadable: None,
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
