//! Running this workspace's binaries against the test cluster: each with
//! the cluster's kubeconfig, `/metrics` on a free loopback port, its output
//! in `target/e2e-logs/<name>.log`, and killed when dropped.

use std::{
    net::SocketAddr,
    path::PathBuf,
    process::{ExitStatus, Stdio},
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    process::{Child, Command},
};

use crate::{HarnessError, Result, cluster::kubeconfig_path, shipped::Part, wait::within};

/// A binary of this workspace, as `cargo build` left it (`make e2e` builds
/// them first); from `GPUHEALTH_BIN_DIR` when set (the benchmark runs
/// release builds).
pub fn built(name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("GPUHEALTH_BIN_DIR") {
        return PathBuf::from(dir).join(name);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../target")));
    target.join("debug").join(name)
}

fn io(e: std::io::Error) -> HarnessError {
    HarnessError::ClusterStart(e.to_string())
}

/// How a started program is told where to serve `/metrics`.
#[derive(Clone, Copy)]
enum MetricsAddress {
    /// `FLAG=ADDR`.
    Flag(&'static str),
    /// `GPUHEALTH_METRICS_ADDR`, leaving the flags to the caller.
    Environment,
}

/// gpuhealth's own binaries' flag.
const OUR_FLAG: MetricsAddress = MetricsAddress::Flag("--metrics-addr");

/// A process's capability sets, as masks of `linux/capability.h`'s numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldCapabilities {
    pub effective: u64,
    pub permitted: u64,
    pub bounding: u64,
    pub no_new_privileges: bool,
}

/// A process's `/proc/<pid>/status`, as the kernel wrote it.
pub struct ProcStatus {
    pid: u32,
    text: String,
}

impl ProcStatus {
    pub fn of(pid: u32) -> Result<ProcStatus> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(io)?;
        Ok(ProcStatus { pid, text })
    }

    /// The value of the line `name` (`"NSpid:"`), trimmed; empty if none.
    pub fn field(&self, name: &str) -> &str {
        self.text
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .map_or("", str::trim)
    }

    pub fn capabilities(&self) -> Result<HeldCapabilities> {
        let set = |name: &str| {
            u64::from_str_radix(self.field(name), 16)
                .map_err(|e| HarnessError::Invalid(format!("{name} of pid {}: {e}", self.pid)))
        };
        Ok(HeldCapabilities {
            effective: set("CapEff:")?,
            permitted: set("CapPrm:")?,
            bounding: set("CapBnd:")?,
            no_new_privileges: self.field("NoNewPrivs:") == "1",
        })
    }
}

/// The mask of capabilities named as `setpriv` names them (lower case,
/// without `CAP_`): the ones the shipped manifests add.
pub fn capability_mask(names: &[String]) -> Result<u64> {
    names.iter().try_fold(0u64, |mask, name| {
        let number = match name.as_str() {
            "dac_read_search" => 2,
            "sys_ptrace" => 19,
            "sys_admin" => 21,
            "sys_boot" => 22,
            "syslog" => 34,
            other => {
                return Err(HarnessError::Invalid(format!(
                    "a capability the harness does not know: {other}"
                )));
            }
        };
        Ok(mask | 1u64 << number)
    })
}

/// A running binary.
pub struct Process {
    child: Child,
    pub name: String,
    pub log: PathBuf,
    pub metrics: SocketAddr,
}

impl Process {
    /// Starts `binary` as `name`; `configure` adds its own flags and
    /// environment.
    pub async fn launch(
        binary: &str,
        name: &str,
        configure: impl FnOnce(&mut Command),
    ) -> Result<Process> {
        Process::start(binary, name, OUR_FLAG, configure).await
    }

    /// Like [`Process::launch`], with no flag of the harness's own: the
    /// metrics address goes in `GPUHEALTH_METRICS_ADDR`, so that `configure`
    /// gives exactly the flags a manifest ships. The agent runs short of
    /// the capabilities `without` names (as `setpriv` names them) of those
    /// its manifest adds: as a container that lacks them would.
    pub async fn launch_with_flags_of_its_own(
        binary: &str,
        name: &str,
        without: &[&str],
        configure: impl FnOnce(&mut Command),
    ) -> Result<Process> {
        let how = MetricsAddress::Environment;
        Process::start_at(built(binary), binary, name, how, without, configure).await
    }

    /// Like [`Process::launch`], from the binary at `bin` rather than this
    /// workspace's build of `binary` (another release's).
    pub async fn launch_from(
        bin: PathBuf,
        binary: &str,
        name: &str,
        configure: impl FnOnce(&mut Command),
    ) -> Result<Process> {
        Process::start_at(bin, binary, name, OUR_FLAG, &[], configure).await
    }

    /// A program not of this workspace (a peer controller), started from
    /// `bin` with its metrics address given as `metrics_flag=ADDR`.
    pub async fn launch_peer(
        bin: PathBuf,
        name: &str,
        metrics_flag: &'static str,
        configure: impl FnOnce(&mut Command),
    ) -> Result<Process> {
        let binary = bin
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let metrics = MetricsAddress::Flag(metrics_flag);
        Process::start_at(bin, &binary, name, metrics, &[], configure).await
    }

    async fn start(
        binary: &str,
        name: &str,
        metrics: MetricsAddress,
        configure: impl FnOnce(&mut Command),
    ) -> Result<Process> {
        Process::start_at(built(binary), binary, name, metrics, &[], configure).await
    }

    async fn start_at(
        bin: PathBuf,
        binary: &str,
        name: &str,
        how: MetricsAddress,
        without: &[&str],
        configure: impl FnOnce(&mut Command),
    ) -> Result<Process> {
        let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../target/e2e-logs"));
        std::fs::create_dir_all(&dir).map_err(io)?;
        let log = dir.join(format!("{name}.log"));
        let file = std::fs::File::create(&log).map_err(io)?;
        let err = file.try_clone().map_err(io)?;
        let metrics = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(io)?;
            listener.local_addr().map_err(io)?
        };
        let mut command = Command::new(&bin);
        command.env("KUBECONFIG", kubeconfig_path().await?);
        match how {
            MetricsAddress::Flag(flag) => command.arg(format!("{flag}={metrics}")),
            MetricsAddress::Environment => {
                command.env("GPUHEALTH_METRICS_ADDR", metrics.to_string())
            }
        };
        configure(&mut command);
        if binary == "gpuhealth-agent" {
            command = confined(&command, without).await?;
        }
        command
            .stdout(Stdio::from(file))
            .stderr(Stdio::from(err))
            .kill_on_drop(true);
        let child = command.spawn().map_err(|e| {
            HarnessError::ClusterStart(format!(
                "starting {}: {e} (run `cargo build -p {binary}`)",
                bin.display()
            ))
        })?;
        Ok(Process {
            child,
            name: name.to_owned(),
            log,
            metrics,
        })
    }

    /// What it has logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Its process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Its capability sets as the kernel holds them, and whether it may
    /// gain more.
    pub fn capabilities(&self) -> Result<HeldCapabilities> {
        let pid = self
            .pid()
            .ok_or_else(|| HarnessError::Invalid(format!("{} is not running", self.name)))?;
        ProcStatus::of(pid)?.capabilities()
    }

    /// Whether it has exited by itself.
    pub fn has_exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// Kills it at once (SIGKILL), as a crash would.
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }

    /// Asks it to stop (SIGTERM), as a Deployment's rolling update does.
    pub async fn terminate(&self) -> Result<()> {
        self.signal("TERM").await
    }

    /// Stops it where it is (SIGSTOP), as a replica starved of CPU or
    /// stuck in a long pause would be, until [`Process::resume`].
    pub async fn stall(&self) -> Result<()> {
        self.signal("STOP").await
    }

    /// Lets a stalled process go on (SIGCONT).
    pub async fn resume(&self) -> Result<()> {
        self.signal("CONT").await
    }

    async fn signal(&self, which: &str) -> Result<()> {
        let Some(pid) = self.pid() else {
            return Ok(());
        };
        let status = tokio::process::Command::new("kill")
            .args([format!("-{which}"), pid.to_string()])
            .status()
            .await
            .map_err(io)?;
        if !status.success() {
            return Err(HarnessError::ClusterStart(format!(
                "kill -{which} {pid} ({}): {status}",
                self.name
            )));
        }
        Ok(())
    }

    /// Waits for the process to exit by itself.
    pub async fn exited(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let what = format!("{} to exit", self.name);
        within(&what, timeout, async {
            self.child.wait().await.map_err(io)
        })
        .await
    }

    /// The text of its `/metrics`, once the endpoint answers.
    pub async fn scrape(&self) -> Result<String> {
        let (_, body) = self.get("/metrics", |status| status == 200).await?;
        Ok(body)
    }

    /// The status code and body of `path` (`/livez`, `/readyz`), once the
    /// endpoint answers with a status that `accept` takes.
    pub async fn get(&self, path: &str, accept: impl Fn(u16) -> bool) -> Result<(u16, String)> {
        let what = format!("{path} of {}", self.name);
        within(&what, Duration::from_secs(30), async {
            loop {
                if let Ok((status, body)) = http_get(self.metrics, path).await
                    && accept(status)
                {
                    return Ok((status, body));
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        })
        .await
    }
}

/// A plain HTTP/1.0 GET: enough for a test to read `/metrics`.
async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other(format!("no HTTP response: {response}")))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no status: {head}")))?;
    Ok((status, body.to_owned()))
}

/// The agent as its shipped containers run it: root, with only the
/// capabilities `config/agent/container-toolkit` adds to the part its
/// `--role` names (both parts' where it runs both), the bounding set
/// holding the rest out of reach, and no new privileges; less those
/// `without` names. Every e2e test of the agent runs it so.
async fn confined(agent: &Command, without: &[&str]) -> Result<Command> {
    let agent = agent.as_std();
    let args: Vec<String> = agent
        .get_args()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let role = args.iter().enumerate().find_map(|(i, a)| {
        a.strip_prefix("--role=")
            .map(str::to_owned)
            .or_else(|| (a == "--role").then(|| args.get(i + 1).cloned().unwrap_or_default()))
    });
    let parts: Vec<Part> = Part::BOTH
        .into_iter()
        .filter(|p| role.as_deref().is_none_or(|r| r == "both" || r == p.role()))
        .collect();
    let mut capabilities = Vec::new();
    for part in parts {
        for c in shipped_capabilities(part).await? {
            if !capabilities.contains(&c) && !without.contains(&c.as_str()) {
                capabilities.push(c);
            }
        }
    }
    let bounding: String = std::iter::once("-all".to_owned())
        .chain(capabilities.iter().map(|c| format!("+{c}")))
        .collect::<Vec<_>>()
        .join(",");
    let mut command = Command::new("setpriv");
    command
        .args([
            "--no-new-privs",
            "--inh-caps",
            "-all",
            "--bounding-set",
            &bounding,
            "--",
        ])
        .arg(agent.get_program())
        .args(&args);
    for (key, value) in agent.get_envs() {
        match value {
            Some(v) => command.env(key, v),
            None => command.env_remove(key),
        };
    }
    Ok(command)
}

/// What `config/agent/container-toolkit` adds to `part`, read once.
async fn shipped_capabilities(part: Part) -> Result<Vec<String>> {
    static REPORTER: tokio::sync::OnceCell<Vec<String>> = tokio::sync::OnceCell::const_new();
    static EXECUTOR: tokio::sync::OnceCell<Vec<String>> = tokio::sync::OnceCell::const_new();
    let cell = match part {
        Part::Reporter => &REPORTER,
        Part::Executor => &EXECUTOR,
    };
    cell.get_or_try_init(|| crate::shipped::shipped_capabilities("container-toolkit", part))
        .await
        .cloned()
}
