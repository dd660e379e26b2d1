//! A GPU reset that can succeed on a real node: the GPU Operator's operands
//! paused, the executor's own NVML let go and the reporter asked to let go
//! of its own (through [`crate::handoff`]), persistence mode turned off where
//! it is on (`nvidia-smi -pm 0`: `nvidia-persistenced`, which the driver
//! counts as a client, then closes the GPU), every other holder of the GPU
//! gone (or named, and nothing tried), `nvidia-smi --gpu-reset` with a
//! deadline, then the GPU confirmed: NVML sees it with nothing more to do,
//! and the kubelet offers it again. Persistence mode and the operands come
//! back whatever happens.

use std::{path::PathBuf, time::Duration};

use gpuhealth_api::contract::Outcome;
use k8s_openapi::{api::core::v1::Node, apimachinery::pkg::api::resource::Quantity};
use kube::{Api, Client, ResourceExt};

use crate::{
    done::Done,
    handoff::Handoff,
    holders::{self, Holder},
    nvidia_smi::NvidiaSmi,
    nvml::{DeviceReading, not_recovered},
    nvml_thread::Gpus,
    operands::Operands,
};

/// The resource the NVIDIA device plugin offers.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";

pub struct ResetSettings {
    /// How `nvidia-smi` is run.
    pub nvidia_smi: NvidiaSmi,
    /// Where the GPUs' device nodes are (`/dev`).
    pub dev_dir: PathBuf,
    /// Where the node's processes are (`/proc`, with the host's PID namespace).
    pub proc_dir: PathBuf,
    /// How long `nvidia-smi --gpu-reset` may take.
    pub timeout: Duration,
    /// How long the GPU's other holders get to let go once the operands are
    /// paused.
    pub let_go: Duration,
    /// How long the kubelet gets to offer the reset GPU again.
    pub back_in_service: Duration,
    /// Holders the driver does not count (none by default).
    pub tolerated: Vec<String>,
    pub operands: Operands,
    /// Where the reporter is asked to let go of the GPUs.
    pub handoff: Handoff,
}

/// Resets the GPUs `uuids` of `node`.
pub async fn reset(
    gpus: &impl Gpus,
    s: &ResetSettings,
    client: &Client,
    node: &Node,
    id: &str,
    uuids: &[String],
) -> Done {
    let readings = match gpus.read().await {
        Ok(r) => r,
        Err(e) => return (Outcome::Failed, format!("reading the GPUs first: {e}")),
    };
    let mut targets = Vec::new();
    for uuid in uuids {
        match readings.iter().find(|r| &r.uuid == uuid) {
            Some(r) => targets.push(r.clone()),
            None => {
                return (
                    Outcome::Refused,
                    format!("there is no GPU {uuid} on this node"),
                );
            }
        }
    }
    // A process on the GPU means the drain did not empty it: never kill it.
    let running: Vec<String> = targets
        .iter()
        .filter_map(|r| {
            let pids: Vec<String> = r
                .compute_processes
                .iter()
                .chain(&r.graphics_processes)
                .map(|pid| describe_pid(s, *pid))
                .collect();
            (!pids.is_empty()).then(|| format!("{} runs {}", name(r), pids.join(", ")))
        })
        .collect();
    if !running.is_empty() {
        return (
            Outcome::Refused,
            format!("not reset: {}", running.join("; ")),
        );
    }
    let paused = match s.operands.pause(client, node).await {
        Ok(p) => p,
        Err(e) => return (Outcome::Failed, e),
    };
    let (mut outcome, mut message) = reset_released(gpus, s, id, &targets).await;
    if outcome == Outcome::Succeeded {
        (outcome, message) = confirm(gpus, &targets, message).await;
    }
    if !paused.is_empty() {
        match s.operands.restore(client, &node.name_any(), &paused).await {
            Ok(()) => message.push_str(&format!(
                "; the GPU Operator's operands paused and restored: {}",
                paused.join(", ")
            )),
            Err(e) => {
                outcome = Outcome::Failed;
                message.push_str(&format!("; {e} (retried until it is)"));
            }
        }
    }
    if outcome == Outcome::Succeeded {
        (outcome, message) =
            back_in_service(client, &node.name_any(), s.back_in_service, message).await;
    }
    (outcome, message)
}

/// Lets go of NVML (and asks the reporter to), turns persistence mode
/// off, waits for the other holders, resets; turns persistence mode back
/// on and takes NVML back.
async fn reset_released(
    gpus: &impl Gpus,
    s: &ResetSettings,
    id: &str,
    targets: &[DeviceReading],
) -> Done {
    // The reporter lets go within a second or so, and its NVML is one more
    // holder still_held waits out; it takes NVML back when told, or at the
    // latest once the longest this can take has passed.
    let at_most = s.let_go + s.timeout * 2 + Duration::from_secs(60);
    if let Err(e) = s.handoff.ask_to_let_go(id, at_most) {
        return (
            Outcome::Failed,
            format!("asking the reporter to let go of NVML: {e}"),
        );
    }
    if let Err(e) = gpus.release().await {
        let _ = s.handoff.done_with_the_gpus();
        return (Outcome::Failed, format!("letting go of NVML: {e}"));
    }
    let persistent: Vec<&DeviceReading> = targets
        .iter()
        .filter(|r| r.persistence_mode == Some(true))
        .collect();
    let (outcome, mut message) = match persistence(s, &persistent, false).await {
        Err(e) => (Outcome::Failed, e),
        Ok(()) => match still_held(s, targets).await {
            Err(e) => (Outcome::Failed, e),
            Ok(held) if !held.is_empty() => (
                Outcome::Refused,
                format!("not reset, nothing tried: {}", held.join("; ")),
            ),
            Ok(_) => run_resets(s, targets).await,
        },
    };
    if !persistent.is_empty() {
        // Back as it was, whatever happened: the GPU serves without it,
        // so a failure here is said, not counted against the reset.
        match persistence(s, &persistent, true).await {
            Ok(()) => message.push_str("; persistence mode turned off for it and on again"),
            Err(e) => message.push_str(&format!("; turning persistence mode on again: {e}")),
        }
    }
    if let Err(e) = s.handoff.done_with_the_gpus() {
        message.push_str(&format!("; telling the reporter to take NVML back: {e}"));
    }
    let done = (outcome, message);
    match gpus.retake().await {
        Ok(()) => done,
        Err(e) => (
            Outcome::Failed,
            format!("{}; then taking NVML back: {e}", done.1),
        ),
    }
}

/// Waits up to `let_go` for every other holder of the targets to go; what
/// still holds each then.
async fn still_held(s: &ResetSettings, targets: &[DeviceReading]) -> Result<Vec<String>, String> {
    let deadline = tokio::time::Instant::now() + s.let_go;
    loop {
        let mut held = Vec::new();
        for r in targets {
            let Some(minor) = r.minor else {
                return Err(format!("NVML did not say which device node {} is", name(r)));
            };
            let device = s.dev_dir.join(format!("nvidia{minor}"));
            let scan = holders::holding(&s.proc_dir, &device)
                .map_err(|e| format!("looking for what holds {}: {e}", device.display()))?;
            let found: Vec<Holder> = holders::counted(scan.holders, &s.tolerated);
            if !found.is_empty() {
                let list: Vec<String> = found.iter().map(Holder::to_string).collect();
                held.push(format!("{} is held by {}", name(r), list.join(", ")));
            }
            if let Some(first) = scan.unreadable.first() {
                let more = match scan.unreadable.len() - 1 {
                    0 => String::new(),
                    n => format!(" and {n} more"),
                };
                held.push(format!(
                    "whether {} is held cannot be told: {first}{more}",
                    name(r)
                ));
            }
        }
        if held.is_empty() || tokio::time::Instant::now() >= deadline {
            return Ok(held);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Turns persistence mode `on` or off for `targets` with `nvidia-smi -i
/// UUID -pm 1|0` (which asks `nvidia-persistenced` where it runs).
async fn persistence(
    s: &ResetSettings,
    targets: &[&DeviceReading],
    on: bool,
) -> Result<(), String> {
    let mode = if on { "1" } else { "0" };
    for r in targets {
        nvidia_smi(s, &["-i", &r.uuid, "-pm", mode]).await?;
    }
    Ok(())
}

async fn run_resets(s: &ResetSettings, targets: &[DeviceReading]) -> Done {
    for r in targets {
        if let Err(e) = nvidia_smi(s, &["--gpu-reset", "-i", &r.uuid]).await {
            return (Outcome::Failed, e);
        }
    }
    let names: Vec<String> = targets.iter().map(name).collect();
    (Outcome::Succeeded, format!("reset {}", names.join(", ")))
}

/// Runs `nvidia-smi ARGS`, stopped after the reset timeout; what it said
/// when it fails.
async fn nvidia_smi(s: &ResetSettings, args: &[&str]) -> Result<(), String> {
    let what = format!("nvidia-smi {}", args.join(" "));
    let run = s
        .nvidia_smi
        .command(args.iter().copied())
        .map_err(|e| format!("{what}: {e}"))?
        .output();
    match tokio::time::timeout(s.timeout, run).await {
        Ok(Ok(o)) if o.status.success() => Ok(()),
        Ok(Ok(o)) => {
            let said = String::from_utf8_lossy(&o.stdout).trim().to_owned()
                + String::from_utf8_lossy(&o.stderr).trim();
            Err(format!("{what}: {}: {said}", o.status))
        }
        Ok(Err(e)) => Err(format!("running {}: {e}", s.nvidia_smi)),
        Err(_) => Err(format!(
            "{what} did not finish within {:?}; stopped",
            s.timeout
        )),
    }
}

/// The reset GPUs read back through NVML with nothing more to do.
async fn confirm(gpus: &impl Gpus, targets: &[DeviceReading], message: String) -> Done {
    let readings = match gpus.read().await {
        Ok(r) => r,
        Err(e) => {
            return (
                Outcome::Failed,
                format!("{message}, but reading it back: {e}"),
            );
        }
    };
    for t in targets {
        let why = match readings.iter().find(|r| r.uuid == t.uuid) {
            None => Some("NVML no longer lists it".to_owned()),
            Some(r) => not_recovered(r),
        };
        if let Some(why) = why {
            return (
                Outcome::Failed,
                format!("{message}, but {}: {why}", name(t)),
            );
        }
    }
    (
        Outcome::Succeeded,
        format!("{message}; NVML reads it back with nothing more to do"),
    )
}

/// Waits for the kubelet to offer every GPU of the node again (allocatable
/// `nvidia.com/gpu` back to capacity): the device plugin withdrew the bad
/// GPU, and only a fresh plugin offers it again.
async fn back_in_service(client: &Client, node: &str, wait: Duration, message: String) -> Done {
    let api: Api<Node> = Api::all(client.clone());
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        let counts = match api.get(node).await {
            Ok(n) => gpu_counts(&n),
            Err(e) => {
                return (
                    Outcome::Failed,
                    format!("{message}, but reading the Node: {e}"),
                );
            }
        };
        match counts {
            // No device plugin offers GPUs here: nothing to wait for.
            None => return (Outcome::Succeeded, message),
            Some((offered, capacity)) if offered >= capacity => {
                return (
                    Outcome::Succeeded,
                    format!("{message}; the kubelet offers {offered} of {capacity} {GPU_RESOURCE}"),
                );
            }
            Some((offered, capacity)) if tokio::time::Instant::now() >= deadline => {
                return (
                    Outcome::Failed,
                    format!(
                        "{message}, but after {wait:?} the kubelet offers {offered} of {capacity} {GPU_RESOURCE}: the device plugin has not taken the GPU back (restart its pod on this node)"
                    ),
                );
            }
            Some(_) => tokio::time::sleep(Duration::from_secs(1)).await,
        }
    }
}

/// Allocatable and capacity `nvidia.com/gpu`, when the node has any.
pub fn gpu_counts(node: &Node) -> Option<(u64, u64)> {
    let status = node.status.as_ref()?;
    let count = |m: &Option<std::collections::BTreeMap<String, Quantity>>| {
        m.as_ref()
            .and_then(|m| m.get(GPU_RESOURCE))
            .and_then(|q| q.0.parse::<u64>().ok())
    };
    let capacity = count(&status.capacity)?;
    Some((count(&status.allocatable).unwrap_or(0), capacity))
}

fn name(r: &DeviceReading) -> String {
    format!("GPU {} ({})", r.index, r.uuid)
}

fn describe_pid(s: &ResetSettings, pid: u32) -> String {
    format!("{} (pid {pid})", holders::command(&s.proc_dir, pid))
}
