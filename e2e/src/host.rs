//! The host under a simulated GPU node, as the real agent binary meets it
//! on a real one, with a stand-in at each outermost boundary:
//!
//! - the GPUs: the NVML stand-in (`nvml-standin/`, built by `build.rs`):
//!   `libnvidia-ml.so.1` and `nvidia-smi`, whose GPUs are files under a
//!   directory of the host's, with each GPU's device node there;
//! - the kernel log: a file of `/dev/kmsg` records;
//! - the kubelet: its PodResources socket, answering from the pods the API
//!   server has bound to the node, each given free GPUs as the kubelet's
//!   device manager would, and giving them back when the pod goes;
//! - the GPU Operator's device plugin: a process holding every GPU while
//!   its node label `nvidia.com/gpu.deploy.device-plugin` is `true`, which
//!   withdraws a GPU from the Node's allocatable `nvidia.com/gpu` on a
//!   critical Xid and offers every GPU again only when it starts afresh;
//! - the system bus: a real `dbus-daemon`, with systemd-logind's Reboot
//!   answered and counted for a caller holding `CAP_SYS_BOOT`, refused to
//!   any other, as logind does without polkit;
//! - `nvidia-persistenced`: the stand-in's, holding every GPU in
//!   persistence mode until `nvidia-smi -pm 0` asks it to let one go.

use std::{
    io::Write,
    path::{Path, PathBuf},
    process::Stdio,
    sync::{Arc, Mutex},
};

use gpuhealth_agent::pod_resources::proto::pod_resources_lister_server::PodResourcesListerServer;
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api, Client,
    api::{Patch, PatchParams},
};
use serde_json::json;
use tokio::process::{Child, Command};

use crate::{
    HarnessError, Result, pod_resources,
    process::Process,
    shipped::{Part, shipped},
    system_bus,
    wait::Background,
};

mod device_plugin;

use device_plugin::{DevicePlugin, hold};

/// Where `build.rs` put the NVML stand-in.
pub const STANDIN: &str = env!("GPUHEALTH_NVML_STANDIN");
/// The GPU Operator's label for its device plugin on a node.
pub const DEVICE_PLUGIN_LABEL: &str = "nvidia.com/gpu.deploy.device-plugin";

fn io(what: &str) -> impl Fn(std::io::Error) -> HarnessError + '_ {
    move |e| HarnessError::ClusterStart(format!("{what}: {e}"))
}

/// GPU `i`'s UUID on a simulated host.
pub fn uuid(i: usize) -> String {
    format!("GPU-5e1f0000-0000-4000-8000-{i:012}")
}

/// GPU `i`'s PCI bus id, as NVML writes it.
pub fn pci(i: usize) -> String {
    format!("00000000:{:02X}:00.0", 0x18 + i)
}

/// The simulated host of one node.
pub struct Host {
    pub node: String,
    pub gpus: usize,
    /// Everything of the host's: the stand-in's GPUs (`nvml/`), the kernel
    /// log, the agent's state, the kubelet's socket, the system bus.
    pub dir: PathBuf,
    tasks: Vec<Background>,
    device_plugin: Arc<Mutex<Option<Child>>>,
    /// Reboot calls systemd-logind received.
    pub reboots: Arc<Mutex<u32>>,
    bus: Option<Child>,
    persistenced: Option<Child>,
    /// Where nvidia-persistenced's and the system bus's sockets are: in
    /// `dir` for a simulated host (several share a machine), at their real
    /// paths for the real node.
    persistenced_socket: PathBuf,
    bus_socket: PathBuf,
}

/// The agent's two parts on a host, each its own process.
pub struct Agent {
    pub reporter: Process,
    pub executor: Process,
}

impl Agent {
    pub async fn kill(&mut self) {
        self.reporter.kill().await;
        self.executor.kill().await;
    }
}

impl Host {
    /// A host of `gpus` healthy GPUs for `node`.
    pub fn new(node: &str, gpus: usize) -> Result<Host> {
        let dir = std::env::temp_dir().join(format!("gpuhealth-host-{node}"));
        Host::at(
            dir.clone(),
            node,
            gpus,
            dir.join("persistenced.sock"),
            dir.join("system_bus_socket"),
        )
    }

    /// The host of the real node (e2e/node/): its GPUs' state where the
    /// node's runtime finds it, its sockets at their real paths.
    pub fn real(node: &str, gpus: usize) -> Result<Host> {
        Host::at(
            PathBuf::from("/var/lib/gpuhealth-e2e-host"),
            node,
            gpus,
            "/run/nvidia-persistenced/socket".into(),
            "/run/dbus/system_bus_socket".into(),
        )
    }

    fn at(
        dir: PathBuf,
        node: &str,
        gpus: usize,
        persistenced_socket: PathBuf,
        bus_socket: PathBuf,
    ) -> Result<Host> {
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["nvml/gpu", "nvml/dev", "state"] {
            std::fs::create_dir_all(dir.join(sub)).map_err(io("the host's directories"))?;
        }
        std::fs::write(dir.join("nvml/dev/nvidiactl"), b"").map_err(io("nvidiactl"))?;
        std::fs::write(dir.join("nvml/events"), b"").map_err(io("events"))?;
        std::fs::write(dir.join("kmsg"), b"").map_err(io("kmsg"))?;
        let host = Host {
            node: node.to_owned(),
            gpus,
            dir,
            tasks: Vec::new(),
            device_plugin: Arc::default(),
            reboots: Arc::default(),
            bus: None,
            persistenced: None,
            persistenced_socket,
            bus_socket,
        };
        for i in 0..gpus {
            std::fs::write(host.nvml().join(format!("dev/nvidia{i}")), b"")
                .map_err(io("a device node"))?;
            let gpu = format!(
                "uuid={}\npci={}\nname=NVIDIA H200\nminor={i}\nrecovery_action=0\nremap_pending=0\nremap_failure=0\necc_uncorrected=0\nreset=ok\n",
                uuid(i),
                pci(i)
            );
            std::fs::write(host.nvml().join(format!("gpu/{i}")), gpu).map_err(io("a GPU"))?;
        }
        Ok(host)
    }

    /// The stand-in's GPUs (`$NVML_STANDIN_ROOT`).
    pub fn nvml(&self) -> PathBuf {
        self.dir.join("nvml")
    }

    pub fn state_dir(&self) -> PathBuf {
        self.dir.join("state")
    }

    pub fn kmsg(&self) -> PathBuf {
        self.dir.join("kmsg")
    }

    fn persistenced_socket(&self) -> PathBuf {
        self.persistenced_socket.clone()
    }

    fn socket(&self) -> PathBuf {
        self.dir.join("kubelet.sock")
    }

    /// Sets `key` of GPU `gpu` (see `nvml-standin/README.md`).
    pub fn set(&self, gpu: usize, key: &str, value: &str) -> Result<()> {
        let path = self.nvml().join(format!("gpu/{gpu}"));
        let text = std::fs::read_to_string(&path).map_err(io("a GPU"))?;
        let mut lines: Vec<String> = text
            .lines()
            .filter(|l| !l.starts_with(&format!("{key}=")))
            .map(String::from)
            .collect();
        lines.push(format!("{key}={value}"));
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, lines.join("\n") + "\n").map_err(io("a GPU"))?;
        std::fs::rename(&tmp, &path).map_err(io("a GPU"))
    }

    pub fn get(&self, gpu: usize, key: &str) -> Option<String> {
        let text = std::fs::read_to_string(self.nvml().join(format!("gpu/{gpu}"))).ok()?;
        text.lines()
            .filter_map(|l| l.strip_prefix(&format!("{key}=")))
            .next_back()
            .map(String::from)
    }

    /// The driver reports Xid `code` on GPU `gpu`: an NVML event, and a
    /// kernel log record stamped `ago` before now.
    pub fn xid(&self, gpu: usize, code: u32, text: &str, ago: std::time::Duration) -> Result<()> {
        self.nvml_xid(gpu, code)?;
        self.kernel_log_xid(gpu, code, text, ago)
    }

    /// GPU `gpu` as in the incident: its recovery action set to a reset,
    /// Xid 119, then 154 asking for the reset.
    pub fn incident_fault(&self, gpu: usize) -> Result<()> {
        self.set(gpu, "recovery_action", "1")?;
        let now = std::time::Duration::ZERO;
        self.xid(
            gpu,
            119,
            "Timeout after 45s of waiting for RPC response from GPU GSP",
            now,
        )?;
        self.xid(
            gpu,
            154,
            "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
            now,
        )
    }

    /// Xid `code` on GPU `gpu` as an NVML event only (what
    /// `nvmlEventSetWait` hands the agent).
    pub fn nvml_xid(&self, gpu: usize, code: u32) -> Result<()> {
        let mut events = std::fs::OpenOptions::new()
            .append(true)
            .open(self.nvml().join("events"))
            .map_err(io("events"))?;
        writeln!(events, "{gpu} {code}").map_err(io("events"))
    }

    /// Xid `code` on GPU `gpu` as a kernel log record only, stamped `ago`
    /// before now, as the driver logs it.
    pub fn kernel_log_xid(
        &self,
        gpu: usize,
        code: u32,
        text: &str,
        ago: std::time::Duration,
    ) -> Result<()> {
        let since_boot = since_boot().saturating_sub(ago);
        // `0000:1f:00`, as the driver logs it.
        let bus = &pci(gpu)[4..14];
        let mut kmsg = std::fs::OpenOptions::new()
            .append(true)
            .open(self.kmsg())
            .map_err(io("kmsg"))?;
        writeln!(
            kmsg,
            "4,{},{},-;NVRM: Xid (PCI:{}): {code}, {text}",
            since_boot.as_micros(),
            since_boot.as_micros(),
            bus.to_lowercase()
        )
        .map_err(io("kmsg"))
    }

    /// The resets `nvidia-smi` attempted: `(uuid, ok|refused|failed)`.
    pub fn resets(&self) -> Vec<(String, String)> {
        std::fs::read_to_string(self.nvml().join("resets"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.split_once(' '))
            .map(|(u, o)| (u.to_owned(), o.to_owned()))
            .collect()
    }

    /// A process holding GPU `gpu`'s device node open, as a monitoring
    /// daemon would; it stops when dropped.
    pub async fn hold(&self, gpu: usize) -> Result<Child> {
        let device = self.nvml().join(format!("dev/nvidia{gpu}"));
        hold(&[device]).await
    }

    /// The environment that puts the agent on this host.
    pub fn environment(&self) -> Vec<(String, String)> {
        let path = format!("{STANDIN}:{}", std::env::var("PATH").unwrap_or_default());
        let mut env = vec![
            ("NODE_NAME".into(), self.node.clone()),
            (
                "NVML_STANDIN_ROOT".into(),
                self.nvml().display().to_string(),
            ),
            ("LD_LIBRARY_PATH".into(), STANDIN.into()),
            (
                "NVML_STANDIN_PERSISTENCED_SOCKET".into(),
                self.persistenced_socket().display().to_string(),
            ),
            ("PATH".into(), path),
            (
                "GPUHEALTH_DEV_DIR".into(),
                self.nvml().join("dev").display().to_string(),
            ),
            (
                "GPUHEALTH_STATE_DIR".into(),
                self.state_dir().display().to_string(),
            ),
            (
                "GPUHEALTH_KMSG_PATH".into(),
                self.kmsg().display().to_string(),
            ),
            (
                "GPUHEALTH_POD_RESOURCES_SOCKET".into(),
                self.socket().display().to_string(),
            ),
            ("RUST_LOG".into(), "info,kube=warn".into()),
        ];
        if self.bus.is_some() {
            let address = format!("unix:path={}", self.bus_socket.display());
            env.push(("DBUS_SYSTEM_BUS_ADDRESS".into(), address));
        }
        env
    }

    /// Starts the agent on this host as `config/agent/container-toolkit`
    /// ships it: each part a process of its own with the flags its
    /// DaemonSet ships, then `extra`, and no flag of the harness's own; the
    /// reporter with a state directory of its own and the executor's to
    /// read, as their hostPaths give them.
    pub async fn start_agent(&self, name: &str, extra: &[&str]) -> Result<Agent> {
        self.start_agent_short_of(name, extra, &[]).await
    }

    /// As [`Host::start_agent`], the executor short of the capabilities
    /// `without` names (as `setpriv` names them): as a container without
    /// them would run it.
    pub async fn start_agent_short_of(
        &self,
        name: &str,
        extra: &[&str],
        without: &[&str],
    ) -> Result<Agent> {
        Ok(Agent {
            reporter: self.start_part(name, Part::Reporter, extra, &[]).await?,
            executor: self
                .start_executor(&format!("{name}-executor"), extra, without)
                .await?,
        })
    }

    /// The executor alone, short of the capabilities `without` names.
    pub async fn start_executor(
        &self,
        name: &str,
        extra: &[&str],
        without: &[&str],
    ) -> Result<Process> {
        self.start_part(name, Part::Executor, extra, without).await
    }

    async fn start_part(
        &self,
        name: &str,
        part: Part,
        extra: &[&str],
        without: &[&str],
    ) -> Result<Process> {
        let (mut args, _) = shipped("container-toolkit", part).await?;
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        let mut env = self.environment();
        if part == Part::Reporter {
            let own = self.state_dir().join("reporter");
            env.retain(|(key, _)| key != "GPUHEALTH_STATE_DIR");
            env.push(("GPUHEALTH_STATE_DIR".into(), own.display().to_string()));
            env.push((
                "GPUHEALTH_EXECUTOR_STATE_DIR".into(),
                self.state_dir().display().to_string(),
            ));
        }
        Process::launch_with_flags_of_its_own("gpuhealth-agent", name, without, |command| {
            command.args(&args).envs(env);
        })
        .await
    }

    /// The kubelet's PodResources: each pod the API server binds to the node
    /// gets the lowest free GPU, until it goes.
    pub fn kubelet(&mut self, client: &Client) -> Result<()> {
        let _ = std::fs::remove_file(self.socket());
        let listener =
            tokio::net::UnixListener::bind(self.socket()).map_err(io("the kubelet socket"))?;
        let kubelet = pod_resources::Kubelet {
            client: client.clone(),
            node: self.node.clone(),
            gpus: (0..self.gpus).map(uuid).collect(),
            given: Arc::default(),
        };
        self.tasks.push(Background::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(PodResourcesListerServer::new(kubelet))
                .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener))
                .await;
        }));
        Ok(())
    }

    /// The GPU Operator's device plugin on this node: runs while its label
    /// is `true`, holding every GPU, and keeps the Node's allocatable
    /// `nvidia.com/gpu` as the kubelet would from what it offers.
    pub async fn device_plugin(&mut self, client: &Client) -> Result<()> {
        let nodes: Api<Node> = Api::all(client.clone());
        let patch = json!({"metadata": {"labels": {DEVICE_PLUGIN_LABEL: "true"}}});
        nodes
            .patch(&self.node, &PatchParams::default(), &Patch::Merge(patch))
            .await?;
        let devices: Vec<PathBuf> = (0..self.gpus)
            .map(|i| self.nvml().join(format!("dev/nvidia{i}")))
            .collect();
        let plugin = DevicePlugin {
            nodes,
            node: self.node.clone(),
            gpus: self.gpus,
            devices,
            events: self.nvml().join("events"),
            running: self.device_plugin.clone(),
        };
        self.tasks.push(Background::spawn(plugin.run()));
        Ok(())
    }

    /// Whether the simulated device plugin is running now: its process,
    /// which held every GPU when it started, still alive.
    pub fn device_plugin_running(&self) -> bool {
        let mut plugin = lock(&self.device_plugin);
        plugin
            .as_mut()
            .is_some_and(|child| matches!(child.try_wait(), Ok(None)))
    }

    /// `nvidia-persistenced` (the stand-in's) on this host: persistence
    /// mode on for every GPU, each held open until it is turned off. Its
    /// socket is up when this returns.
    pub async fn persistenced(&mut self) -> Result<()> {
        let mut command = Command::new(format!("{STANDIN}/nvidia-persistenced"));
        command.env("NVML_STANDIN_ROOT", self.nvml());
        self.start_persistenced(command).await
    }

    /// `nvidia-persistenced` moved into a driver root (see `e2e/node/`), as
    /// a node whose driver comes from the GPU Operator's driver container
    /// runs it: the one running stopped, the root's own started with its
    /// socket inside the root and no `NVML_STANDIN_ROOT` (it finds the GPUs
    /// from where it is installed).
    pub async fn persistenced_in_driver_root(&mut self, root: &Path) -> Result<()> {
        if let Some(mut old) = self.persistenced.take() {
            let _ = old.kill().await;
            let _ = std::fs::remove_file(&self.persistenced_socket);
        }
        self.persistenced_socket = root.join("run/nvidia-persistenced/socket");
        let mut command = Command::new(root.join("usr/bin/nvidia-persistenced"));
        command.env_remove("NVML_STANDIN_ROOT");
        self.start_persistenced(command).await
    }

    async fn start_persistenced(&mut self, mut command: Command) -> Result<()> {
        // Its directory first: the daemon binds its socket as it starts.
        let socket = self.persistenced_socket();
        if let Some(dir) = socket.parent() {
            std::fs::create_dir_all(dir).map_err(io("nvidia-persistenced's directory"))?;
        }
        let child = command
            .env(
                "NVML_STANDIN_PERSISTENCED_SOCKET",
                self.persistenced_socket(),
            )
            .stdout(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(io("starting the nvidia-persistenced stand-in"))?;
        self.persistenced = Some(child);
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
        while !socket.exists() {
            if tokio::time::Instant::now() > deadline {
                return Err(HarnessError::ClusterStart(
                    "the nvidia-persistenced stand-in made no socket".into(),
                ));
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// A real `dbus-daemon` as the host's system bus, and systemd-logind on
    /// it ([`crate::system_bus`]), counting the Reboot calls it accepts.
    pub async fn system_bus(&mut self) -> Result<()> {
        let bus = system_bus::start(&self.bus_socket, &self.dir, self.reboots.clone()).await?;
        self.tasks.push(bus.answering);
        self.bus = Some(bus.daemon);
        Ok(())
    }
}

/// The sockets this host's services made go with them.
impl Drop for Host {
    fn drop(&mut self) {
        if self.bus.is_some() {
            let _ = std::fs::remove_file(&self.bus_socket);
        }
        if self.persistenced.is_some() {
            let _ = std::fs::remove_file(&self.persistenced_socket);
            // Its directory, where this made it (an empty one only).
            if let Some(dir) = self.persistenced_socket.parent() {
                let _ = std::fs::remove_dir(dir);
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How long this machine has been up: what `/dev/kmsg` stamps records with.
fn since_boot() -> std::time::Duration {
    let up = std::fs::read_to_string("/proc/uptime").unwrap_or_default();
    let secs: f64 = up
        .split_whitespace()
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0.0);
    std::time::Duration::from_secs_f64(secs)
}
