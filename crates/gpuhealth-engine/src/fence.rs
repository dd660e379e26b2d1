//! Per-GPU quarantine: what the node's device layer offers to keep new work
//! off one GPU, and how much of the node an incident takes out of service.

use gpuhealth_api::{
    RecoveryAction,
    policy::DrainScope,
    quarantine::{Fenced, FencedGpu, GpuFence, Quarantine, QuarantineScope, rule_name},
    vocabulary::{DeviceId, QuarantineWhy},
};
use k8s_openapi::jiff::Timestamp;

/// A device of the policy's DRA driver on the node, as its ResourceSlice
/// publishes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceView {
    pub driver: String,
    pub pool: String,
    pub name: String,
    /// Its GPU's UUID (the `uuid` attribute), if it names one.
    pub uuid: Option<String>,
    /// Taints its driver put on it (`gpu.nvidia.com/xid`, ...).
    pub taints: Vec<DeviceTaintView>,
}

impl DeviceView {
    /// Its id, as DRA names a device in a claim's results.
    pub fn id(&self) -> DeviceId {
        DeviceId::new(&self.driver, &self.pool, &self.name)
    }

    /// Whether `id` names it (without building its own id to compare).
    pub fn is(&self, id: &DeviceId) -> bool {
        self.driver == id.driver && self.pool == id.pool && self.name == id.device
    }
}

/// A taint on a device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceTaintView {
    pub key: String,
    pub value: Option<String>,
    pub effect: String,
    pub time_added: Option<Timestamp>,
}

/// One of gpuhealth's `DeviceTaintRule`s for the node, as observed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleView {
    pub name: String,
    /// The incident its label names.
    pub incident: String,
    /// When the API server made it (to the second).
    pub created: Option<Timestamp>,
}

/// The node's DRA devices and gpuhealth's rules over them; present only
/// where the cluster serves ResourceSlices.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DraView {
    /// Whether the cluster serves `DeviceTaintRule`s: a GPU can be fenced.
    pub can_taint: bool,
    /// The policy's driver's devices on the node, with the taints it put
    /// on them; empty when it publishes none there.
    pub devices: Vec<DeviceView>,
    pub rules: Vec<RuleView>,
}

/// A device plugin's extended resource on the node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResourceCount {
    pub capacity: u32,
    pub allocatable: u32,
}

impl ResourceCount {
    /// Whether the plugin offers exactly the GPUs that are not bad: it has
    /// withdrawn the `bad` ones and no other.
    pub fn withdrew_exactly(self, bad: usize) -> bool {
        u32::try_from(bad).is_ok_and(|bad| self.capacity.checked_sub(bad) == Some(self.allocatable))
    }
}

/// A GPU the incident is about.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadGpu {
    pub uuid: String,
    pub index: Option<u32>,
    /// Whether the kubelet still offers it through a device plugin, as the
    /// node's report says (`offered`); None: not said.
    pub offered: Option<bool>,
}

/// Whether a device plugin keeps new pods off every GPU of `bad`: the node
/// offers exactly the others, and no report says one of `bad` is offered.
/// The count alone cannot tell which GPUs are withdrawn.
pub fn plugin_fences(count: Option<ResourceCount>, bad: &[BadGpu]) -> bool {
    count.is_some_and(|c| c.withdrew_exactly(bad.len()))
        && !bad.iter().any(|g| g.offered == Some(true))
}

/// What there is to decide on.
pub struct Ask<'a> {
    pub policy: &'a Quarantine,
    pub incident: &'a str,
    /// The GPUs the incident is about; empty: not one GPU's fault.
    pub gpus: &'a [BadGpu],
    /// The step it starts with; None: a drain for maintenance.
    pub step: Option<RecoveryAction>,
    pub drain_scope: DrainScope,
    /// Why the pods holding the GPUs are not known, if they are not.
    pub holders_unknown: Option<&'a str>,
    pub dra: Option<&'a DraView>,
    pub plugin: Option<ResourceCount>,
}

/// How much of the node to take out of service, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    pub scope: Fenced,
    pub why: QuarantineWhy,
    pub message: String,
    /// The GPUs fenced one by one (empty for the node).
    pub gpus: Vec<FencedGpu>,
}

impl Choice {
    fn node(why: QuarantineWhy, message: String) -> Choice {
        Choice {
            scope: Fenced::Node,
            why,
            message,
            gpus: Vec::new(),
        }
    }
}

/// The widest first: the policy, then the step, then whether a fence holds
/// for every bad GPU. A bad GPU is never left schedulable: where no fence
/// holds, the node is cordoned.
pub fn choose(ask: &Ask<'_>) -> Choice {
    use QuarantineWhy as Why;
    let auto = ask.policy.scope == QuarantineScope::Auto;
    if ask.policy.scope == QuarantineScope::Node {
        return Choice::node(
            Why::PolicyScopeNode,
            "the policy's quarantine.scope is Node".into(),
        );
    }
    let Some(step) = ask.step else {
        return Choice::node(Why::NotOneGpu, "a maintenance takes the whole node".into());
    };
    if ask.gpus.is_empty() {
        return Choice::node(Why::NotOneGpu, "the signal names no single GPU".into());
    }
    if step >= RecoveryAction::NodeReboot {
        return Choice::node(
            Why::StepTakesTheNode,
            format!("{step:?} takes the whole node down"),
        );
    }
    if auto && ask.drain_scope != DrainScope::AffectedPods {
        return Choice::node(
            Why::DrainTakesMore,
            format!(
                "the policy's drain.scope {:?} takes more than the GPUs' holders",
                ask.drain_scope
            ),
        );
    }
    if auto && let Some(why) = ask.holders_unknown {
        return Choice::node(
            Why::HoldersUnknown,
            format!("the drain would take every GPU pod: {why}"),
        );
    }
    if let Some(gpus) = by_device_taint(ask) {
        let names: Vec<String> = gpus.iter().map(gpu_name).collect();
        return Choice {
            scope: Fenced::Gpu,
            why: Why::GpusFenced,
            message: format!(
                "{} fenced by DeviceTaintRule (NoSchedule); the node takes new work",
                names.join(", ")
            ),
            gpus,
        };
    }
    if let Some(count) = ask.plugin.filter(|_| plugin_fences(ask.plugin, ask.gpus)) {
        let gpus: Vec<FencedGpu> = ask
            .gpus
            .iter()
            .map(|g| FencedGpu {
                uuid: g.uuid.clone(),
                index: g.index,
                fence: GpuFence::DevicePlugin,
                device: None,
                rule: None,
            })
            .collect();
        let names: Vec<String> = gpus.iter().map(gpu_name).collect();
        return Choice {
            scope: Fenced::Gpu,
            why: Why::GpusFenced,
            message: format!(
                "{} withdrawn by the device plugin ({} of {} {} allocatable); the node takes new work",
                names.join(", "),
                count.allocatable,
                count.capacity,
                ask.policy.device_plugin_resource
            ),
            gpus,
        };
    }
    Choice::node(Why::NoDeviceFence, no_fence(ask))
}

/// Each bad GPU's device, tainted by a rule of its own; None unless every
/// one has a device.
fn by_device_taint(ask: &Ask<'_>) -> Option<Vec<FencedGpu>> {
    let dra = ask.dra.filter(|d| d.can_taint)?;
    ask.gpus
        .iter()
        .map(|g| {
            let device = dra
                .devices
                .iter()
                .find(|d| d.uuid.as_deref() == Some(g.uuid.as_str()))?;
            Some(FencedGpu {
                uuid: g.uuid.clone(),
                index: g.index,
                fence: GpuFence::DeviceTaintRule,
                device: Some(device.id()),
                rule: Some(rule_name(ask.incident, &device.name)),
            })
        })
        .collect()
}

fn no_fence(ask: &Ask<'_>) -> String {
    let dra = match ask.dra {
        None => "the cluster serves no ResourceSlice".to_owned(),
        Some(d) if !d.can_taint => "the cluster serves no DeviceTaintRule".to_owned(),
        Some(d) if d.devices.is_empty() => format!(
            "no ResourceSlice of driver {} lists the node's GPUs",
            ask.policy.dra_driver
        ),
        Some(_) => format!(
            "no device of driver {} names the bad GPU's UUID",
            ask.policy.dra_driver
        ),
    };
    let offered: Vec<String> = ask
        .gpus
        .iter()
        .filter(|g| g.offered == Some(true))
        .map(|g| {
            g.index
                .map_or_else(|| g.uuid.clone(), |i| format!("GPU {i}"))
        })
        .collect();
    let plugin = match ask.plugin {
        None => format!("the node offers no {}", ask.policy.device_plugin_resource),
        Some(_) if !offered.is_empty() => format!(
            "the kubelet still offers {} (the node's report)",
            offered.join(", ")
        ),
        Some(c) => format!(
            "the device plugin offers {} of {} {}, not {} (all but the {} bad)",
            c.allocatable,
            c.capacity,
            ask.policy.device_plugin_resource,
            c.capacity.saturating_sub(ask.gpus.len() as u32),
            ask.gpus.len()
        ),
    };
    format!("no fence holds for the bad GPU alone: {dra}; {plugin}")
}

/// `GPU 7`, or the UUID where the index is not known.
pub fn gpu_name(g: &FencedGpu) -> String {
    match g.index {
        Some(i) => format!("GPU {i}"),
        None => g.uuid.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(i: u32) -> DeviceView {
        DeviceView {
            driver: "gpu.nvidia.com".into(),
            pool: "node-a".into(),
            name: format!("gpu-{i}"),
            uuid: Some(format!("GPU-{i}")),
            taints: Vec::new(),
        }
    }

    fn ask<'a>(policy: &'a Quarantine, gpus: &'a [BadGpu], dra: Option<&'a DraView>) -> Ask<'a> {
        Ask {
            policy,
            incident: "inc-1-ab",
            gpus,
            step: Some(RecoveryAction::GpuReset),
            drain_scope: DrainScope::AffectedPods,
            holders_unknown: None,
            dra,
            plugin: None,
        }
    }

    /// A node's eight GPUs as DRA devices, on a cluster that can taint them.
    fn eight_devices() -> DraView {
        DraView {
            can_taint: true,
            devices: (0..8).map(device).collect(),
            rules: Vec::new(),
        }
    }

    fn gpu7() -> Vec<BadGpu> {
        vec![BadGpu {
            uuid: "GPU-7".into(),
            index: Some(7),
            offered: None,
        }]
    }

    #[test]
    fn a_dra_device_for_the_bad_gpu_fences_it_alone() {
        let policy = Quarantine::default();
        let dra = eight_devices();
        let gpus = gpu7();
        let c = choose(&ask(&policy, &gpus, Some(&dra)));
        assert_eq!(c.scope, Fenced::Gpu, "{c:?}");
        assert_eq!(c.gpus.len(), 1);
        assert_eq!(
            c.gpus[0].device,
            Some(DeviceId::new("gpu.nvidia.com", "node-a", "gpu-7"))
        );
        assert_eq!(c.gpus[0].rule.as_deref(), Some("gpuhealth-inc-1-ab-gpu-7"));
        assert!(
            c.message.starts_with("GPU 7 fenced by DeviceTaintRule"),
            "{}",
            c.message
        );
    }

    #[test]
    fn the_node_is_cordoned_when_anything_needs_it() {
        let dra = eight_devices();
        let gpus = gpu7();
        let node_policy = Quarantine {
            scope: QuarantineScope::Node,
            ..Quarantine::default()
        };
        assert_eq!(
            choose(&ask(&node_policy, &gpus, Some(&dra))).why,
            QuarantineWhy::PolicyScopeNode
        );
        let policy = Quarantine::default();
        let mut reboot = ask(&policy, &gpus, Some(&dra));
        reboot.step = Some(RecoveryAction::NodeReboot);
        assert_eq!(choose(&reboot).why, QuarantineWhy::StepTakesTheNode);
        let mut maintenance = ask(&policy, &gpus, Some(&dra));
        maintenance.step = None;
        assert_eq!(choose(&maintenance).why, QuarantineWhy::NotOneGpu);
        assert_eq!(
            choose(&ask(&policy, &[], Some(&dra))).why,
            QuarantineWhy::NotOneGpu
        );
        let mut unknown = ask(&policy, &gpus, Some(&dra));
        unknown.holders_unknown = Some("the kubelet did not answer");
        assert_eq!(choose(&unknown).why, QuarantineWhy::HoldersUnknown);
        let gpu_policy = Quarantine {
            scope: QuarantineScope::Gpu,
            ..Quarantine::default()
        };
        let mut unknown = ask(&gpu_policy, &gpus, Some(&dra));
        unknown.holders_unknown = Some("the kubelet did not answer");
        assert_eq!(
            choose(&unknown).scope,
            Fenced::Gpu,
            "Gpu fences whoever holds it"
        );
        let mut wide = ask(&policy, &gpus, Some(&dra));
        wide.drain_scope = DrainScope::GpuPods;
        assert_eq!(choose(&wide).why, QuarantineWhy::DrainTakesMore);
        let c = choose(&ask(&policy, &gpus, None));
        assert_eq!(c.why, QuarantineWhy::NoDeviceFence);
        assert!(
            c.message.contains("serves no ResourceSlice"),
            "{}",
            c.message
        );
        let untaintable = DraView {
            can_taint: false,
            ..dra.clone()
        };
        let c = choose(&ask(&policy, &gpus, Some(&untaintable)));
        assert_eq!(c.why, QuarantineWhy::NoDeviceFence);
        assert!(
            c.message.contains("serves no DeviceTaintRule"),
            "{}",
            c.message
        );
    }

    #[test]
    fn a_device_plugin_fences_only_when_it_withdrew_exactly_the_bad_gpus() {
        let policy = Quarantine::default();
        let gpus = gpu7();
        let mut a = ask(&policy, &gpus, None);
        a.plugin = Some(ResourceCount {
            capacity: 8,
            allocatable: 7,
        });
        let c = choose(&a);
        assert_eq!(c.scope, Fenced::Gpu, "{c:?}");
        assert_eq!(c.gpus[0].fence, GpuFence::DevicePlugin);
        for allocatable in [8, 6] {
            a.plugin = Some(ResourceCount {
                capacity: 8,
                allocatable,
            });
            let c = choose(&a);
            assert_eq!(c.why, QuarantineWhy::NoDeviceFence, "{allocatable}: {c:?}");
            assert!(
                c.message.contains(&format!("offers {allocatable} of 8")),
                "{}",
                c.message
            );
        }
    }
}
