//! `gpuhealth.io/gpus`: one entry per GPU, written by the node agent or any
//! other detector. Versioned, so a reader refuses what it does not understand
//! instead of guessing.

use std::collections::HashSet;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::{Deserialize, Serialize};

use super::{
    AnnotationValue, ContractError, GPU_REPORT_ANNOTATION,
    checks::{bounded_text, dns_label, dns_subdomain, gpu_uuid, invalid, pci_bus_id},
};
use crate::types::GpuHealth;

const MAX_GPUS: usize = 64;
const MAX_XIDS_PER_GPU: usize = 32;
const MAX_PODS_PER_GPU: usize = 64;
const MAX_TEXT: usize = 512;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuReport {
    /// The report format; this build reads [`GpuReport::VERSION`].
    pub version: u32,
    /// When the producer read the GPUs.
    pub observed_at: Time,
    /// Who wrote it (`gpuhealth-agent/nvml`, `gpuhealth-agent/fake`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// What the producer can carry out on this node. Absent: it does not
    /// say, and the operator requests any rung of the ladder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capabilities: Option<Capabilities>,
    /// Why the producer cannot read the GPUs now, if it cannot: `gpus` are
    /// then the last ones it read (or none). Nothing is acted on from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unreadable: Option<String>,
    pub gpus: Vec<GpuEntry>,
}

/// What a node's agent can carry out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Capabilities {
    /// It resets GPUs (`gpuhealth.io/reset-request`).
    pub reset: bool,
    /// How it reboots the node (`gpuhealth.io/reboot-request`).
    pub reboot: RebootMethod,
}

/// How an agent reboots its node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum RebootMethod {
    /// It does not: reboot requests are refused.
    None,
    /// Asks systemd-logind over the system D-Bus socket.
    Logind,
    /// Leaves the reboot to kured, through its sentinel file.
    Kured,
}

impl Capabilities {
    /// Whether the agent can carry out `action` at all (replacing a node is
    /// never the agent's).
    pub fn can(&self, action: crate::RecoveryAction) -> bool {
        match action {
            crate::RecoveryAction::GpuReset => self.reset,
            crate::RecoveryAction::NodeReboot => self.reboot != RebootMethod::None,
            crate::RecoveryAction::ReplaceNode => true,
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GpuEntry {
    /// NVML index; for display only, since index order is not stable.
    pub index: u32,
    pub uuid: String,
    pub pci_bus_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub product: Option<String>,
    pub health: GpuHealth,
    /// Recent Xids, newest last.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub xids: Vec<XidEvent>,
    /// NVML field 230 / the Xid 154 hex value: 0 none, 1 reset, 2 reboot, ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recovery_action: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub remapped_rows: Option<RemappedRows>,
    /// Pods holding this GPU, from the kubelet PodResources API.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<PodRef>,
    /// Why the pods holding this GPU are not known, when they are not (the
    /// kubelet did not answer, or a device it handed out names no GPU the
    /// producer can place): `pods` may then miss some, and a drain for this
    /// GPU takes every GPU pod of the node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods_unknown: Option<String>,
    /// Whether the kubelet offers this GPU (or a slice of it) to new pods
    /// through a device plugin (PodResources `GetAllocatableResources`);
    /// unset where no device plugin offers the node's GPUs, or it is not
    /// known. A bad GPU the kubelet still offers is not fenced by its plugin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offered: Option<bool>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct XidEvent {
    pub code: u32,
    pub at: Time,
    #[serde(default)]
    pub text: String,
    /// The process the driver named in the Xid's line (`pid=`), if it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pid: Option<u32>,
    /// Its name (`name=`), as the process chose it: for people, never
    /// for deciding.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process: Option<String>,
    /// The pod that held the GPU when the Xid was logged, where the
    /// producer could tell (one pod held it): whose fault an application
    /// Xid is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodRef>,
    /// Seen only in the kernel log while NVML's own Xid events were up,
    /// and not confirmed by NVML in time: reported, never acted on.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub uncorroborated: bool,
}

impl XidEvent {
    /// An Xid as a line or an event first tells it: no process, no pod,
    /// not in doubt.
    pub fn new(code: u32, at: Time, text: impl Into<String>) -> XidEvent {
        XidEvent {
            code,
            at,
            text: text.into(),
            pid: None,
            process: None,
            pod: None,
            uncorroborated: false,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RemappedRows {
    pub pending: bool,
    pub failure: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
}

impl GpuReport {
    pub const VERSION: u32 = 1;

    /// GPUs that cannot serve as they are.
    pub fn bad_gpus(&self) -> impl Iterator<Item = &GpuEntry> {
        self.gpus.iter().filter(|g| !g.health.is_serving())
    }

    /// The Xids of the GPUs pod `namespace/name` holds: a restart right
    /// after one is the GPU's doing, not the workload's.
    pub fn xids_of_pod(&self, namespace: &str, name: &str) -> Vec<XidEvent> {
        self.gpus
            .iter()
            .filter(|g| {
                g.pods
                    .iter()
                    .any(|p| p.namespace == namespace && p.name == name)
            })
            .flat_map(|g| g.xids.iter().cloned())
            .collect()
    }
}

impl AnnotationValue for GpuReport {
    const ANNOTATION: &'static str = GPU_REPORT_ANNOTATION;

    fn check(&self) -> Result<(), ContractError> {
        let bad = |field: String, reason: String| invalid(Self::ANNOTATION, field, reason);
        if self.version != Self::VERSION {
            return Err(ContractError::UnsupportedVersion {
                annotation: Self::ANNOTATION,
                found: self.version,
                supported: Self::VERSION,
            });
        }
        if let Some(source) = &self.source {
            bounded_text(source, 128).map_err(|r| bad("source".into(), r))?;
        }
        if let Some(why) = &self.unreadable {
            bounded_text(why, MAX_TEXT).map_err(|r| bad("unreadable".into(), r))?;
        }
        if self.gpus.len() > MAX_GPUS {
            return Err(bad(
                "gpus".into(),
                format!("{} entries, at most {MAX_GPUS}", self.gpus.len()),
            ));
        }
        let mut indexes = HashSet::new();
        let mut uuids = HashSet::new();
        for (i, gpu) in self.gpus.iter().enumerate() {
            let at = |f: &str| format!("gpus[{i}].{f}");
            gpu_uuid(&gpu.uuid).map_err(|r| bad(at("uuid"), r))?;
            pci_bus_id(&gpu.pci_bus_id).map_err(|r| bad(at("pciBusId"), r))?;
            if !indexes.insert(gpu.index) {
                return Err(bad(
                    at("index"),
                    format!("index {} appears twice", gpu.index),
                ));
            }
            if !uuids.insert(gpu.uuid.as_str()) {
                return Err(bad(at("uuid"), "uuid appears twice".into()));
            }
            if let Some(product) = &gpu.product {
                bounded_text(product, 128).map_err(|r| bad(at("product"), r))?;
            }
            if gpu.xids.len() > MAX_XIDS_PER_GPU {
                return Err(bad(
                    at("xids"),
                    format!("{} entries, at most {MAX_XIDS_PER_GPU}", gpu.xids.len()),
                ));
            }
            for (j, xid) in gpu.xids.iter().enumerate() {
                let xf = |f: &str| format!("gpus[{i}].xids[{j}].{f}");
                bounded_text(&xid.text, MAX_TEXT).map_err(|r| bad(xf("text"), r))?;
                if let Some(process) = &xid.process {
                    bounded_text(process, 64).map_err(|r| bad(xf("process"), r))?;
                }
                if let Some(pod) = &xid.pod {
                    dns_label(&pod.namespace).map_err(|r| bad(xf("pod.namespace"), r))?;
                    dns_subdomain(&pod.name).map_err(|r| bad(xf("pod.name"), r))?;
                    if let Some(c) = &pod.container {
                        dns_label(c).map_err(|r| bad(xf("pod.container"), r))?;
                    }
                }
            }
            if let Some(why) = &gpu.pods_unknown {
                bounded_text(why, MAX_TEXT).map_err(|r| bad(at("podsUnknown"), r))?;
            }
            if gpu.pods.len() > MAX_PODS_PER_GPU {
                return Err(bad(
                    at("pods"),
                    format!("{} entries, at most {MAX_PODS_PER_GPU}", gpu.pods.len()),
                ));
            }
            for (j, pod) in gpu.pods.iter().enumerate() {
                let pf = |f: &str| format!("gpus[{i}].pods[{j}].{f}");
                dns_label(&pod.namespace).map_err(|r| bad(pf("namespace"), r))?;
                dns_subdomain(&pod.name).map_err(|r| bad(pf("name"), r))?;
                if let Some(c) = &pod.container {
                    dns_label(c).map_err(|r| bad(pf("container"), r))?;
                }
            }
        }
        Ok(())
    }
}
