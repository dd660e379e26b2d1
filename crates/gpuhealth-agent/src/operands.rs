//! The GPU Operator's operands that hold GPUs (its device plugin, DCGM,
//! dcgm-exporter, GPU feature discovery) let go for a reset the way the
//! operator's own driver upgrades make them: their per-node label
//! `nvidia.com/gpu.deploy.<operand>` goes from `true` to a `paused-for-…`
//! value, their DaemonSets' node selectors stop matching and the pods leave;
//! set back to `true`, they return. The device plugin comes back fresh and
//! offers the reset GPU again (it never takes back a GPU it once marked
//! unhealthy).
//!
//! What was paused is written to the agent's state directory before the
//! labels change, so that an agent that dies mid-reset restores them when it
//! starts again.

use std::{
    fs,
    path::{Path, PathBuf},
};

use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client, ResourceExt, api::Patch};
use serde_json::json;

/// The value a label is paused with.
pub const PAUSED: &str = "paused-for-gpuhealth-reset";

/// The GPU Operator's operands that open GPUs, by their deploy labels.
pub const DEFAULT_OPERANDS: [&str; 6] = [
    "nvidia.com/gpu.deploy.device-plugin",
    "nvidia.com/gpu.deploy.dcgm",
    "nvidia.com/gpu.deploy.dcgm-exporter",
    "nvidia.com/gpu.deploy.gpu-feature-discovery",
    "nvidia.com/gpu.deploy.dcgm-dra",
    "nvidia.com/gpu.deploy.dcgm-exporter-dra",
];

pub struct Operands {
    /// The deploy labels to pause (those set to `true` on the node).
    pub labels: Vec<String>,
    /// Where what is paused is recorded.
    record: PathBuf,
}

impl Operands {
    pub fn new(labels: Vec<String>, state_dir: &Path) -> Operands {
        Operands {
            labels,
            record: state_dir.join("paused-operands.json"),
        }
    }

    /// Pauses the operands scheduled on `node`; returns the labels paused.
    pub async fn pause(&self, client: &Client, node: &Node) -> Result<Vec<String>, String> {
        let on_node = node.labels();
        let paused: Vec<String> = self
            .labels
            .iter()
            .filter(|l| on_node.get(*l).map(String::as_str) == Some("true"))
            .cloned()
            .collect();
        if paused.is_empty() {
            return Ok(paused);
        }
        let bytes = serde_json::to_vec(&paused).map_err(|e| e.to_string())?;
        fs::write(&self.record, bytes).map_err(|e| {
            format!(
                "recording the paused operands in {}: {e}",
                self.record.display()
            )
        })?;
        let labels: serde_json::Map<String, serde_json::Value> =
            paused.iter().map(|l| (l.clone(), json!(PAUSED))).collect();
        Api::<Node>::all(client.clone())
            .patch(
                &node.name_any(),
                &crate::patch_params(),
                &Patch::Merge(json!({"metadata": {"labels": labels}})),
            )
            .await
            .map_err(|e| {
                format!(
                    "pausing the GPU Operator's operands ({}): {e}",
                    paused.join(", ")
                )
            })?;
        Ok(paused)
    }

    /// Sets each paused label back to `true`, unless someone has changed it
    /// since (the GPU Operator's own upgrade, say): theirs stands.
    pub async fn restore(
        &self,
        client: &Client,
        node: &str,
        paused: &[String],
    ) -> Result<(), String> {
        let api = Api::<Node>::all(client.clone());
        for label in paused {
            let path = format!(
                "/metadata/labels/{}",
                label.replace('~', "~0").replace('/', "~1")
            );
            let patch: json_patch::Patch = serde_json::from_value(json!([
                {"op": "test", "path": path, "value": PAUSED},
                {"op": "replace", "path": path, "value": "true"},
            ]))
            .map_err(|e| e.to_string())?;
            match api
                .patch(node, &crate::patch_params(), &Patch::Json::<()>(patch))
                .await
            {
                Ok(_) => {}
                // The test failed: no longer ours to restore.
                Err(kube::Error::Api(e)) if e.code == 422 => {
                    tracing::info!(label, "left as someone else set it");
                }
                Err(e) => return Err(format!("restoring {label}=true: {e}")),
            }
        }
        match fs::remove_file(&self.record) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(format!("{}: {e}", self.record.display())),
        }
    }

    /// What an earlier run paused and did not restore, if anything.
    pub fn left_paused(&self) -> Vec<String> {
        fs::read(&self.record)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    }
}
