//! Running the real `gpuhealth-agent` binary, fake backend, for a simulated node.

use std::{
    net::SocketAddr,
    path::PathBuf,
    process::{ExitStatus, Stdio},
    time::Duration,
};

use gpuhealth_agent::backend::{SIM_HARDWARE_ANNOTATION, SimHardware};
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api, Client,
    api::{Patch, PatchParams},
};
use serde_json::json;
use tokio::process::{Child, Command};

use crate::{
    HarnessError, Result,
    cluster::kubeconfig_path,
    operator::{built, free_port, io, log_file, scrape},
    wait::within,
};

/// A running agent; killed when dropped.
pub struct AgentProcess {
    child: Child,
    pub name: String,
    pub log: PathBuf,
    pub metrics: SocketAddr,
}

impl AgentProcess {
    /// Serves `node` with the fake backend, journalling in `state_dir`.
    /// `crash_after`: `GPUHEALTH_TEST_CRASH_AFTER` (`begun` or `finished`).
    pub async fn start(
        name: &str,
        node: &str,
        state_dir: &std::path::Path,
        crash_after: Option<&str>,
    ) -> Result<AgentProcess> {
        AgentProcess::start_with(name, node, state_dir, crash_after, &["--backend", "fake"]).await
    }

    /// Any backend: `args` are passed on (`--backend`, paths).
    pub async fn start_with(
        name: &str,
        node: &str,
        state_dir: &std::path::Path,
        crash_after: Option<&str>,
        args: &[&str],
    ) -> Result<AgentProcess> {
        let (log, file) = log_file(name)?;
        let err = file.try_clone().map_err(io)?;
        let bin = built("gpuhealth-agent");
        let metrics = free_port()?;
        let mut command = Command::new(&bin);
        command
            .env("KUBECONFIG", kubeconfig_path().await?)
            .env("RUST_LOG", "info,kube=warn")
            .args(args)
            .args(["--node-name", node])
            .args(["--metrics-addr", &metrics.to_string()])
            .arg("--state-dir")
            .arg(state_dir)
            .stdout(Stdio::from(file))
            .stderr(Stdio::from(err))
            .kill_on_drop(true);
        if let Some(point) = crash_after {
            command.env("GPUHEALTH_TEST_CRASH_AFTER", point);
        }
        let child = command.spawn().map_err(|e| {
            HarnessError::ClusterStart(format!(
                "starting {}: {e} (run `cargo build -p gpuhealth-agent`)",
                bin.display()
            ))
        })?;
        Ok(AgentProcess {
            child,
            name: name.to_owned(),
            log,
            metrics,
        })
    }

    /// The text of its `/metrics`.
    pub async fn scrape(&self) -> Result<String> {
        scrape(self.metrics, &format!("agent {}", self.name)).await
    }

    pub async fn exited(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let what = format!("agent {} to exit", self.name);
        within(&what, timeout, async {
            self.child.wait().await.map_err(io)
        })
        .await
    }
}

/// Sets the simulated hardware of `node`: what the fake backend reads.
pub async fn set_hardware(client: &Client, node: &str, hardware: &SimHardware) -> Result<()> {
    let value = serde_json::to_string(hardware)?;
    let patch = json!({"metadata": {"annotations": {SIM_HARDWARE_ANNOTATION: value}}});
    Api::<Node>::all(client.clone())
        .patch(node, &PatchParams::default(), &Patch::Merge(patch))
        .await?;
    Ok(())
}

/// The simulated hardware of `node` as it is now.
pub fn hardware(node: &Node) -> Option<SimHardware> {
    node.metadata
        .annotations
        .as_ref()?
        .get(SIM_HARDWARE_ANNOTATION)
        .and_then(|v| serde_json::from_str(v).ok())
}
