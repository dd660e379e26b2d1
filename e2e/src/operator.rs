//! Running the real operator binary against the test cluster.

use std::{path::PathBuf, process::Stdio};

use tokio::process::{Child, Command};

use crate::{HarnessError, Result, cluster::kubeconfig_path};

/// A running `gpuhealth-operator`; killed when dropped.
pub struct Operator {
    child: Child,
    pub log: PathBuf,
}

fn binary() -> PathBuf {
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../target")));
    target.join("debug/gpuhealth-operator")
}

impl Operator {
    /// Starts the operator built by `cargo build -p gpuhealth-operator`
    /// (`make e2e` builds it first). Its log goes to `target/e2e-logs/<name>.log`.
    pub async fn start(name: &str) -> Result<Operator> {
        let kubeconfig = kubeconfig_path().await?;
        let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../target/e2e-logs"));
        std::fs::create_dir_all(&dir).map_err(|e| HarnessError::ClusterStart(e.to_string()))?;
        let log = dir.join(format!("{name}.log"));
        let file =
            std::fs::File::create(&log).map_err(|e| HarnessError::ClusterStart(e.to_string()))?;
        let err = file
            .try_clone()
            .map_err(|e| HarnessError::ClusterStart(e.to_string()))?;
        let bin = binary();
        let child = Command::new(&bin)
            .env("KUBECONFIG", kubeconfig)
            .env(
                "RUST_LOG",
                std::env::var("GPUHEALTH_E2E_OPERATOR_LOG")
                    .unwrap_or_else(|_| "info,gpuhealth_operator=debug,kube=warn".into()),
            )
            .env("POD_NAME", name)
            .stdout(Stdio::from(file))
            .stderr(Stdio::from(err))
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| {
                HarnessError::ClusterStart(format!(
                    "starting {}: {e} (run `cargo build -p gpuhealth-operator`)",
                    bin.display()
                ))
            })?;
        Ok(Operator { child, log })
    }

    /// Kills it at once, as a crash would.
    pub async fn kill(&mut self) {
        let _ = self.child.kill().await;
    }
}
