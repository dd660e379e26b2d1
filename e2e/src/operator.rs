//! Running the real operator binary against the test cluster.

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

use crate::{HarnessError, Result, cluster::kubeconfig_path, wait::within};

/// Leader-election timings for tests: short, so that a crashed leader's
/// successor does not keep a scenario waiting.
pub const LEASE_DURATION: Duration = Duration::from_secs(6);
pub const RETRY_PERIOD: Duration = Duration::from_secs(1);

/// How to start one replica.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// The leader Lease; replicas that share it elect one leader. Defaults
    /// to the replica's own name, so scenarios never wait on each other.
    pub lease: Option<String>,
    /// `GPUHEALTH_TEST_CRASH_AFTER`: exit right after recording this phase
    /// (`<phase>` or `<phase>:<node>`).
    pub crash_after: Option<String>,
}

/// A running `gpuhealth-operator`; killed when dropped.
pub struct Operator {
    child: Child,
    pub name: String,
    pub log: PathBuf,
    pub metrics: SocketAddr,
}

/// A binary of this workspace, as `cargo build` left it (`make e2e` builds
/// them first).
pub fn built(name: &str) -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../target")));
    target.join("debug").join(name)
}

/// A log file for a process a test starts: `target/e2e-logs/<name>.log`.
pub fn log_file(name: &str) -> Result<(PathBuf, std::fs::File)> {
    let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../target/e2e-logs"));
    std::fs::create_dir_all(&dir).map_err(io)?;
    let log = dir.join(format!("{name}.log"));
    let file = std::fs::File::create(&log).map_err(io)?;
    Ok((log, file))
}

pub(crate) fn io(e: std::io::Error) -> HarnessError {
    HarnessError::ClusterStart(e.to_string())
}

/// A port free now on the loopback interface.
pub(crate) fn free_port() -> Result<SocketAddr> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(io)?;
    listener.local_addr().map_err(io)
}

impl Operator {
    /// Starts the operator built by `cargo build -p gpuhealth-operator`
    /// (`make e2e` builds it first). Its log goes to `target/e2e-logs/<name>.log`.
    pub async fn start(name: &str) -> Result<Operator> {
        Operator::start_with(name, Options::default()).await
    }

    pub async fn start_with(name: &str, options: Options) -> Result<Operator> {
        let kubeconfig = kubeconfig_path().await?;
        let (log, file) = log_file(name)?;
        let err = file.try_clone().map_err(io)?;
        let metrics = free_port()?;
        let bin = built("gpuhealth-operator");
        let secs = |d: Duration| format!("{}s", d.as_secs());
        let mut command = Command::new(&bin);
        command
            .env("KUBECONFIG", kubeconfig)
            .env(
                "RUST_LOG",
                std::env::var("GPUHEALTH_E2E_OPERATOR_LOG")
                    .unwrap_or_else(|_| "info,gpuhealth_operator=debug,kube=warn".into()),
            )
            .env("POD_NAME", name)
            .args(["--metrics-addr", &metrics.to_string()])
            .args(["--lease-name", options.lease.as_deref().unwrap_or(name)])
            .args(["--lease-duration", &secs(LEASE_DURATION)])
            .args(["--renew-deadline", &secs(LEASE_DURATION - 2 * RETRY_PERIOD)])
            .args(["--retry-period", &secs(RETRY_PERIOD)])
            .stdout(Stdio::from(file))
            .stderr(Stdio::from(err))
            .kill_on_drop(true);
        if let Some(phase) = &options.crash_after {
            command.env("GPUHEALTH_TEST_CRASH_AFTER", phase);
        }
        let child = command.spawn().map_err(|e| {
            HarnessError::ClusterStart(format!(
                "starting {}: {e} (run `cargo build -p gpuhealth-operator`)",
                bin.display()
            ))
        })?;
        Ok(Operator {
            child,
            name: name.to_owned(),
            log,
            metrics,
        })
    }

    /// Kills it at once (SIGKILL), as a crash would.
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }

    /// Waits for the process to exit by itself.
    pub async fn exited(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let what = format!("operator {} to exit", self.name);
        within(&what, timeout, async {
            self.child.wait().await.map_err(io)
        })
        .await
    }

    /// The text of `/metrics`, once the endpoint answers.
    pub async fn scrape(&self) -> Result<String> {
        scrape(self.metrics, &format!("operator {}", self.name)).await
    }
}

/// The text of `/metrics` at `addr`, once the endpoint answers.
pub async fn scrape(addr: SocketAddr, who: &str) -> Result<String> {
    let what = format!("/metrics of {who}");
    within(&what, Duration::from_secs(30), async {
        loop {
            if let Ok(body) = http_get(addr, "/metrics").await {
                return Ok(body);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
}

/// A plain HTTP/1.0 GET: enough for a test to read `/metrics`.
async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    match response.split_once("\r\n\r\n") {
        Some((head, body))
            if head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200") =>
        {
            Ok(body.to_owned())
        }
        _ => Err(std::io::Error::other(format!(
            "unexpected response: {response}"
        ))),
    }
}
