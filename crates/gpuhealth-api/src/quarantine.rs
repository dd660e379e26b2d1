//! How much of a node an incident takes out of service: the whole node (a
//! cordon), or only its bad GPUs (a device-level fence), chosen per incident.
//!
//! A GPU is fenced one of two ways. On a cluster with Dynamic Resource
//! Allocation, gpuhealth writes a `DeviceTaintRule` that taints the GPU's
//! device `NoSchedule`, so that the scheduler allocates it to no new claim
//! (`NoExecute` would delete its pods past their disruption budgets, so
//! gpuhealth drains them itself). On a device-plugin cluster, the fence is
//! the plugin's own: once it has withdrawn exactly the bad GPUs from the
//! node's allocatable, the scheduler places no pod on them, and gpuhealth
//! only checks that it stays so.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::vocabulary::QuarantineWhy;

/// The taint gpuhealth's `DeviceTaintRule`s put on a bad GPU's device.
pub const DEVICE_TAINT_KEY: &str = "gpuhealth.io/quarantined";
/// The label on each of gpuhealth's `DeviceTaintRule`s naming its node.
pub const RULE_NODE_LABEL: &str = "gpuhealth.io/node";
/// The label on each of gpuhealth's `DeviceTaintRule`s naming its incident.
pub const RULE_INCIDENT_LABEL: &str = "gpuhealth.io/incident";
/// The label that marks gpuhealth's own objects.
pub const MANAGED_BY_LABEL: (&str, &str) = ("app.kubernetes.io/managed-by", "gpuhealth");

/// What a policy lets an incident take out of service.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum QuarantineScope {
    /// Only the bad GPUs, where a device-level fence holds for each of them,
    /// the drain can be kept to their holders, and the step needs nothing
    /// node-wide; else the node.
    #[default]
    Auto,
    /// Only the bad GPUs wherever a device-level fence holds for each of
    /// them and the step needs nothing node-wide; else the node, with a
    /// finding that says why.
    Gpu,
    /// The whole node: a cordon, as `kubectl cordon` does.
    Node,
}

/// `spec.quarantine`: how an incident keeps new work off what is broken.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Quarantine {
    #[serde(default)]
    pub scope: QuarantineScope,
    /// The DRA driver whose devices are the node's GPUs (its ResourceSlices'
    /// `spec.driver`); each device names its GPU's UUID in the `uuid`
    /// attribute.
    #[serde(default = "default_dra_driver")]
    #[schemars(length(min = 1, max = 63))]
    pub dra_driver: String,
    /// The extended resource a device plugin offers the GPUs as.
    #[serde(default = "default_device_plugin_resource")]
    #[schemars(length(min = 1, max = 253))]
    pub device_plugin_resource: String,
}

fn default_dra_driver() -> String {
    "gpu.nvidia.com".into()
}

fn default_device_plugin_resource() -> String {
    "nvidia.com/gpu".into()
}

impl Default for Quarantine {
    fn default() -> Self {
        Quarantine {
            scope: QuarantineScope::default(),
            dra_driver: default_dra_driver(),
            device_plugin_resource: default_device_plugin_resource(),
        }
    }
}

/// What an incident has taken out of service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum Fenced {
    /// The node is cordoned.
    Node,
    /// Only the GPUs in `gpus`; the node takes new work.
    Gpu,
}

/// How one GPU is kept from new work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum GpuFence {
    /// gpuhealth's `DeviceTaintRule` taints its DRA device `NoSchedule`.
    DeviceTaintRule,
    /// The device plugin has withdrawn it from the node's allocatable.
    DevicePlugin,
}

/// One fenced GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FencedGpu {
    pub uuid: String,
    /// Its index on the node, when the report names it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<u32>,
    pub fence: GpuFence,
    /// Its DRA device, as `driver/pool/device`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<crate::vocabulary::DeviceId>,
    /// The `DeviceTaintRule` that fences it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<String>,
}

/// `status.quarantine`: what the current (or last) incident took out of
/// service, and why that much. Recorded before the fence is put up; kept
/// after recovery until every `DeviceTaintRule` it names is seen gone.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct QuarantineStatus {
    /// The incident it is for.
    pub incident: String,
    pub scope: Fenced,
    pub why: QuarantineWhy,
    /// `why` in words.
    pub message: String,
    /// The GPUs fenced one by one; still listed after the node is cordoned
    /// for a later step, until their fences are lifted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub gpus: Vec<FencedGpu>,
    pub since: Time,
    /// When recovery lifted it; the record goes once its rules are gone.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifted_at: Option<Time>,
}

impl QuarantineStatus {
    /// The `DeviceTaintRule`s it put up.
    pub fn rules(&self) -> impl Iterator<Item = &str> {
        self.gpus.iter().filter_map(|g| g.rule.as_deref())
    }

    /// Whether new work is kept off the GPUs alone, the node serving.
    pub fn per_gpu(&self) -> bool {
        self.scope == Fenced::Gpu && self.lifted_at.is_none()
    }
}

/// The name of the `DeviceTaintRule` that fences `device` for `incident`:
/// one per device and incident, so that a restarted operator finds the rule
/// it wrote, and a new incident's rule never collides with a leftover.
pub fn rule_name(incident: &str, device: &str) -> String {
    let device: String = device
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    let mut name = format!("gpuhealth-{incident}-{device}");
    name.truncate(253);
    name.trim_end_matches('-').to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rule_name_is_a_valid_object_name_per_incident_and_device() {
        let name = rule_name("inc-1780042543-9a371f29eed4", "gpu-7");
        assert_eq!(name, "gpuhealth-inc-1780042543-9a371f29eed4-gpu-7");
        assert_ne!(name, rule_name("inc-1780042543-9a371f29eed4-2", "gpu-7"));
        let odd = rule_name("inc-1-ab", "GPU_7.mig/1");
        assert_eq!(odd, "gpuhealth-inc-1-ab-gpu-7-mig-1");
        let long = rule_name("inc-1-ab", &"x".repeat(400));
        assert!(long.len() <= 253, "{}", long.len());
    }
}
