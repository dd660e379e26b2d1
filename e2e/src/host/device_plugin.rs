//! The GPU Operator's device plugin, as the host under a simulated node
//! runs it: a process holding every GPU while the node's label says so.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api, ResourceExt,
    api::{Patch, PatchParams},
    runtime::watcher,
};
use serde_json::json;
use tokio::process::{Child, Command};

use super::{DEVICE_PLUGIN_LABEL, io, lock};
use crate::{HarnessError, Result, wait::applied};

/// A `sleep` holding `devices` open, returned once it holds every one. In
/// bash: dash opens no descriptor past 9, and its shell died at an
/// eight-GPU host's tenth, holding nothing, while the tests took it for
/// running.
pub(super) async fn hold(devices: &[PathBuf]) -> Result<Child> {
    let opens: String = devices
        .iter()
        .enumerate()
        .map(|(i, d)| format!("exec {}<'{}'; ", i + 3, d.display()))
        .collect();
    let mut child = Command::new("bash")
        .arg("-c")
        .arg(format!("{opens}exec sleep 3600"))
        .kill_on_drop(true)
        .spawn()
        .map_err(io("a process holding a GPU"))?;
    // Held as the agent sees it: its own scan of /proc.
    let pid = child.id().unwrap_or_default();
    let held = |d: &PathBuf| {
        gpuhealth_agent::holders::holding(Path::new("/proc"), d)
            .is_ok_and(|scan| scan.holders.iter().any(|h| h.pid == pid))
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        if devices.iter().all(held) {
            return Ok(child);
        }
        let exited = child.try_wait().map_err(io("a process holding a GPU"))?;
        if exited.is_some() || std::time::Instant::now() > deadline {
            return Err(HarnessError::Invalid(format!(
                "the process to hold {devices:?} exited ({exited:?}) or never opened them all"
            )));
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

pub(super) struct DevicePlugin {
    pub(super) nodes: Api<Node>,
    pub(super) node: String,
    pub(super) gpus: usize,
    pub(super) devices: Vec<PathBuf>,
    pub(super) events: PathBuf,
    pub(super) running: Arc<Mutex<Option<Child>>>,
}

impl DevicePlugin {
    pub(super) async fn run(self) {
        let config = watcher::Config::default().fields(&format!("metadata.name={}", self.node));
        let mut changes = std::pin::pin!(applied(self.nodes.clone(), config));
        let mut tick = tokio::time::interval(std::time::Duration::from_millis(200));
        let mut scheduled = false;
        // What the plugin has read of the XID events, and marked unhealthy.
        let mut read = 0;
        let mut unhealthy: Vec<usize> = Vec::new();
        loop {
            tokio::select! {
                next = changes.next() => match next {
                    Some(n) => scheduled = n.labels().get(DEVICE_PLUGIN_LABEL).map(String::as_str) == Some("true"),
                    None => return,
                },
                _ = tick.tick() => {}
            }
            let running = lock(&self.running).is_some();
            if scheduled && !running {
                // A fresh plugin: every GPU healthy, events from now on.
                match hold(&self.devices).await {
                    Ok(child) => *lock(&self.running) = Some(child),
                    Err(e) => eprintln!("device plugin: {e}"),
                }
                read = std::fs::metadata(&self.events)
                    .map(|m| m.len())
                    .unwrap_or(0);
                unhealthy.clear();
                self.offer(self.gpus).await;
            } else if !scheduled && running {
                // The DaemonSet no longer matches the node: its pod goes.
                *lock(&self.running) = None;
                self.offer(0).await;
            } else if running {
                let text = std::fs::read_to_string(&self.events).unwrap_or_default();
                let new = text.get(read as usize..).unwrap_or_default();
                let complete = new.rfind('\n').map_or(0, |i| i + 1);
                for line in new[..complete].lines() {
                    let mut fields = line.split_whitespace().map(|f| f.parse::<u64>());
                    if let (Some(Ok(gpu)), Some(Ok(code))) = (fields.next(), fields.next())
                        // The plugin ignores application Xids (13, 31, 43, 45, 68, 109).
                        && ![13, 31, 43, 45, 68, 109].contains(&code)
                        && !unhealthy.contains(&(gpu as usize))
                    {
                        unhealthy.push(gpu as usize);
                    }
                }
                if complete > 0 {
                    read += complete as u64;
                    self.offer(self.gpus - unhealthy.len()).await;
                }
            }
        }
    }

    /// The kubelet's allocatable `nvidia.com/gpu`: what the plugin offers.
    async fn offer(&self, gpus: usize) {
        let patch = json!({"status": {"allocatable": {"nvidia.com/gpu": gpus.to_string()}}});
        if let Err(e) = self
            .nodes
            .patch_status(&self.node, &PatchParams::default(), &Patch::Merge(patch))
            .await
        {
            eprintln!("device plugin: allocatable: {e}");
        }
    }
}
