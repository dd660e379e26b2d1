//! Running the real `gpuhealth-agent` binary, fake backend, for a simulated node.

use std::path::Path;

use gpuhealth_agent::fake::{SIM_HARDWARE_ANNOTATION, SimHardware};
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api, Client,
    api::{Patch, PatchParams},
};
use serde_json::json;

use crate::{Result, process::Process};

/// Serves `node` with the fake backend, journalling in `state_dir`.
/// `crash_after`: `GPUHEALTH_TEST_CRASH_AFTER` (`begun` or `finished`).
pub async fn start(
    name: &str,
    node: &str,
    state_dir: &Path,
    crash_after: Option<&str>,
) -> Result<Process> {
    start_with(name, node, state_dir, crash_after, &["--backend", "fake"]).await
}

/// Any backend: `args` are passed on (`--backend`, paths).
pub async fn start_with(
    name: &str,
    node: &str,
    state_dir: &Path,
    crash_after: Option<&str>,
    args: &[&str],
) -> Result<Process> {
    Process::launch("gpuhealth-agent", name, |command| {
        configure(command, node, state_dir, crash_after, args)
    })
    .await
}

/// Like [`start`], from the agent binary at `bin` (another release's)
/// when given.
pub async fn start_from(
    bin: Option<&Path>,
    name: &str,
    node: &str,
    state_dir: &Path,
) -> Result<Process> {
    let Some(bin) = bin else {
        return start(name, node, state_dir, None).await;
    };
    Process::launch_from(bin.to_path_buf(), "gpuhealth-agent", name, |command| {
        configure(command, node, state_dir, None, &["--backend", "fake"])
    })
    .await
}

fn configure(
    command: &mut tokio::process::Command,
    node: &str,
    state_dir: &Path,
    crash_after: Option<&str>,
    args: &[&str],
) {
    command
        .env("RUST_LOG", "info,kube=warn")
        .args(args)
        .args(["--node-name", node])
        .arg("--state-dir")
        .arg(state_dir);
    if let Some(point) = crash_after {
        command.env("GPUHEALTH_TEST_CRASH_AFTER", point);
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
