//! Finding the test cluster and building a client for it.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use kube::{
    Client, Config,
    config::{KubeConfigOptions, Kubeconfig},
};
use tokio::sync::OnceCell;

use crate::{HarnessError, Result};

/// Points the tests at an existing cluster instead of starting one.
pub const KUBECONFIG_ENV: &str = "GPUHEALTH_E2E_KUBECONFIG";

static KUBECONFIG_PATH: OnceCell<PathBuf> = OnceCell::const_new();

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The kubeconfig of the test cluster, starting the local cluster (or
/// reusing the one already running) the first time it is asked for.
pub async fn kubeconfig_path() -> Result<PathBuf> {
    KUBECONFIG_PATH
        .get_or_try_init(|| async {
            if let Some(path) = std::env::var_os(KUBECONFIG_ENV) {
                return Ok(PathBuf::from(path));
            }
            let out = cluster_script(&["up"], None).await?;
            let path = String::from_utf8_lossy(&out)
                .lines()
                .last()
                .unwrap_or_default()
                .trim()
                .to_owned();
            Ok(PathBuf::from(path))
        })
        .await
        .cloned()
}

/// A client for the test cluster.
pub async fn client() -> Result<Client> {
    Ok(Client::try_from(config().await?)?)
}

/// A client for the test cluster that authenticates with `token` alone (a
/// ServiceAccount's), to test what that account may do.
pub async fn client_with_token(token: &str) -> Result<Client> {
    let mut config = config().await?;
    config.auth_info = kube::config::AuthInfo {
        token: Some(token.to_owned().into()),
        ..Default::default()
    };
    Ok(Client::try_from(config)?)
}

/// A kubeconfig file at `path` for the test cluster that authenticates
/// with `token` alone: for running a binary as a ServiceAccount.
pub async fn kubeconfig_with_token(token: &str, path: &Path) -> Result<PathBuf> {
    changed_kubeconfig(path, |kubeconfig| {
        for user in &mut kubeconfig.auth_infos {
            user.auth_info = Some(kube::config::AuthInfo {
                token: Some(token.to_owned().into()),
                ..Default::default()
            });
        }
    })
    .await
}

/// A kubeconfig file at `path` for the test cluster that reaches the API
/// server at `addr` (a proxy in between) instead.
pub async fn kubeconfig_via(addr: std::net::SocketAddr, path: &Path) -> Result<PathBuf> {
    changed_kubeconfig(path, |kubeconfig| {
        for cluster in kubeconfig
            .clusters
            .iter_mut()
            .filter_map(|c| c.cluster.as_mut())
        {
            cluster.server = Some(format!("https://{addr}"));
        }
    })
    .await
}

/// The API server's address, from the kubeconfig.
pub async fn api_server_addr() -> Result<std::net::SocketAddr> {
    let server = config().await?.cluster_url;
    let host = server.host().unwrap_or("127.0.0.1");
    let port = server.port_u16().unwrap_or(443);
    format!("{host}:{port}")
        .parse()
        .map_err(|e| HarnessError::ClusterStart(format!("the API server {server}: {e}")))
}

/// The admin kubeconfig, changed by `change`, written to `path`.
async fn changed_kubeconfig(path: &Path, change: impl FnOnce(&mut Kubeconfig)) -> Result<PathBuf> {
    let admin = kubeconfig_path().await?;
    let mut kubeconfig =
        Kubeconfig::read_from(&admin).map_err(|source| HarnessError::Kubeconfig {
            path: admin.display().to_string(),
            source,
        })?;
    change(&mut kubeconfig);
    let yaml = serde_yaml::to_string(&kubeconfig)
        .map_err(|e| HarnessError::ClusterStart(format!("writing a kubeconfig: {e}")))?;
    std::fs::write(path, yaml)
        .map_err(|e| HarnessError::ClusterStart(format!("writing {}: {e}", path.display())))?;
    Ok(path.to_owned())
}

async fn config() -> Result<Config> {
    let path = kubeconfig_path().await?;
    let kubeconfig = Kubeconfig::read_from(&path).map_err(|source| HarnessError::Kubeconfig {
        path: path.display().to_string(),
        source,
    })?;
    let mut config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|source| HarnessError::Kubeconfig {
            path: path.display().to_string(),
            source,
        })?;
    // Tests see the API server's answers as they are. kube's default retry
    // layer re-sends a 429 up to 15 times honouring Retry-After, which turns
    // an eviction refused by a PodDisruptionBudget into minutes of silence.
    config.default_retry = false;
    Ok(config)
}

/// The kubectl that matches the cluster: the one built with it, else `kubectl`
/// from `PATH`.
fn kubectl_binary(kubeconfig: &Path) -> PathBuf {
    let built = kubeconfig
        .parent()
        .map(|state| state.join("bin"))
        .and_then(|f| std::fs::read_to_string(f).ok());
    match built {
        Some(dir) => PathBuf::from(dir.trim()).join("kubectl"),
        None => PathBuf::from("kubectl"),
    }
}

/// Runs kubectl against the test cluster and returns its standard output.
pub async fn kubectl(args: &[&str]) -> Result<String> {
    let kubeconfig = kubeconfig_path().await?;
    let binary = kubectl_binary(&kubeconfig);
    run_tool("kubectl", binary, &kubeconfig, args).await
}

/// Runs Helm (scripts/helm.sh: the version the repository pins, built on
/// first use) against the test cluster and returns its standard output.
pub async fn helm(args: &[&str]) -> Result<String> {
    let kubeconfig = kubeconfig_path().await?;
    run_tool(
        "helm",
        repo_root().join("scripts/helm.sh"),
        &kubeconfig,
        args,
    )
    .await
}

async fn run_tool(
    tool: &'static str,
    binary: PathBuf,
    kubeconfig: &Path,
    args: &[&str],
) -> Result<String> {
    let failed = |detail: String| HarnessError::Tool {
        tool,
        args: args.join(" "),
        detail,
    };
    // Discovery as the server has it now. kubectl and Helm keep it on disk
    // for six hours, keyed by the server's host and port, which the many
    // clusters a machine starts reuse; a category missing from that cache
    // (`kubectl get gpuhealth`) is never looked up again, and the command
    // failed on a server that had it. A cache of the command's own.
    let cache = std::env::temp_dir().join(crate::unique("gpuhealth-kube-cache"));
    let out = tokio::process::Command::new(binary)
        .env("KUBECACHEDIR", &cache)
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .output()
        .await;
    let _ = std::fs::remove_dir_all(&cache);
    let out = out.map_err(|e| failed(e.to_string()))?;
    if !out.status.success() {
        return Err(failed(String::from_utf8_lossy(&out.stderr).into_owned()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// SIGKILLs one control-plane component of the local cluster (`etcd`,
/// `kube-apiserver`) and starts it again; returns once the API server is
/// ready. Only for the cluster `cluster.sh` started: one in
/// `GPUHEALTH_E2E_KUBECONFIG` elsewhere is not ours to restart.
pub async fn restart(component: &str) -> Result<()> {
    let kubeconfig = kubeconfig_path().await?;
    let state = kubeconfig
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    if !state.join("cmd").join(component).exists() {
        return Err(HarnessError::ClusterStart(format!(
            "{component} was not started by e2e/cluster/cluster.sh in {} (a cluster started before restarts existed, or not a local one)",
            state.display()
        )));
    }
    cluster_script(&["restart", component], Some(&state)).await?;
    Ok(())
}

/// Runs `e2e/cluster/cluster.sh` with `args` (on the cluster in `state`,
/// else the default one); its standard output, or its errors.
async fn cluster_script(args: &[&str], state: Option<&Path>) -> Result<Vec<u8>> {
    let mut command = Command::new(repo_root().join("e2e/cluster/cluster.sh"));
    command.args(args);
    if let Some(state) = state {
        command.env("GPUHEALTH_CLUSTER_DIR", state);
    }
    let out = tokio::task::spawn_blocking(move || command.output())
        .await
        .map_err(|e| HarnessError::ClusterStart(e.to_string()))?
        .map_err(|e| HarnessError::ClusterStart(e.to_string()))?;
    if !out.status.success() {
        return Err(HarnessError::ClusterStart(
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ));
    }
    Ok(out.stdout)
}
