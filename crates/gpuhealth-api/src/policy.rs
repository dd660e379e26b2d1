//! `GpuHealthPolicy`: which nodes gpuhealth manages, what counts as unhealthy,
//! how it recovers them and how much it may disrupt at once.
//!
//! Every field has a default, so a policy with only a `nodeSelector` is
//! complete: detect from the GPU report, reset then reboot, drain only the pods
//! on bad GPUs, one node at a time, stop when a quarter of the nodes are sick.
//! The API server refuses invalid values (schema plus CEL rules); each rule's
//! message names its field.
//!
//! Long because the policy is one API type: every field group, documented
//! for the generated reference, with its defaults and their tests.

use k8s_openapi::apimachinery::pkg::{
    apis::meta::v1::{Condition, LabelSelector},
    util::intstr::IntOrString,
};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{
    contract::{DiagnosticsLevel, GPU_HEALTHY_CONDITION},
    duration::Duration,
    gang::GangDrain,
    quarantine::Quarantine,
    types::{GpuHealth, RecoveryAction, SignalAction},
    vocabulary::PolicyCondition,
};

/// A policy for keeping the GPU nodes it selects healthy.
// Columns: what fits 80 columns in `kubectl get gpuhealth`, where each name
// carries its kind and group; the rest (priority 1) with `-o wide`.
// Each printcolumn(...) repeats the same keys, which clippy mistakes for
// duplicated attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "gpuhealth.io",
    version = "v1alpha1",
    kind = "GpuHealthPolicy",
    shortname = "ghp",
    category = "gpuhealth",
    status = "GpuHealthPolicyStatus",
    doc = "A policy for keeping the GPU nodes it selects healthy: detection, escalation, drain, budgets and verification.",
    printcolumn(name = "Mode", type_ = "string", json_path = ".spec.mode"),
    printcolumn(name = "Nodes", type_ = "integer", json_path = ".status.nodes"),
    printcolumn(
        name = "Healthy",
        type_ = "integer",
        json_path = ".status.healthy",
        priority = 1
    ),
    printcolumn(
        name = "Remediating",
        type_ = "integer",
        json_path = ".status.remediating"
    ),
    printcolumn(name = "Failed", type_ = "integer", json_path = ".status.failed"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp",
        priority = 1
    )
)]
#[serde(rename_all = "camelCase")]
pub struct GpuHealthPolicySpec {
    /// The nodes this policy manages. An empty selector selects every node.
    #[schemars(extend("x-kubernetes-validations" = [
        {
            "rule": "!has(self.matchExpressions) || self.matchExpressions.all(e, e.operator in ['In', 'NotIn', 'Exists', 'DoesNotExist'])",
            "message": "nodeSelector.matchExpressions[].operator must be In, NotIn, Exists or DoesNotExist"
        },
        {
            "rule": "!has(self.matchExpressions) || self.matchExpressions.all(e, (e.operator in ['In', 'NotIn']) == (has(e.values) && size(e.values) > 0))",
            "message": "nodeSelector.matchExpressions[].values must be non-empty for In and NotIn, and empty for Exists and DoesNotExist"
        }
    ]))]
    pub node_selector: LabelSelector,

    /// `Enforce` acts; `DryRun` records the full plan and changes nothing
    /// outside gpuhealth's own objects; `Paused` observes only.
    #[serde(default)]
    pub mode: Mode,

    /// Says that a policy selecting more nodes than the cluster's
    /// fleet-wide bound (the operator's `--fleet-wide-nodes`, 100 by
    /// default) is meant to act on them in `Enforce`: without it, such a
    /// policy enforces nothing and its `Ready` condition says why.
    #[serde(default)]
    pub acknowledge_fleet_wide: bool,

    /// When selectors of several policies match a node, the highest priority
    /// wins (then the name, alphabetically); the others report `Conflict`.
    #[serde(default)]
    #[schemars(range(min = -1000, max = 1000))]
    pub priority: i32,

    /// What counts as unhealthy.
    #[serde(default)]
    pub detection: Detection,

    /// The escalation ladder, weakest action first. Each rung is tried up to
    /// `attempts` times before the next; when the last is exhausted the node
    /// is `Failed`: it stays cordoned for a person.
    #[serde(default = "default_escalation")]
    #[schemars(length(min = 1, max = 3))]
    #[schemars(extend(
        "x-kubernetes-list-type" = "map",
        "x-kubernetes-list-map-keys" = ["action"],
        "x-kubernetes-validations" = [{
            "rule": "self.map(s, s.action == 'GpuReset' ? 0 : (s.action == 'NodeReboot' ? 1 : 2)).isSorted()",
            "message": "escalation must go from weaker to stronger actions: GpuReset, then NodeReboot, then ReplaceNode"
        }]
    ))]
    pub escalation: Vec<EscalationStep>,

    /// How pods leave a node before it is acted on.
    #[serde(default)]
    pub drain: Drain,

    /// How much of a node an incident takes out of service: only the bad
    /// GPUs where a device-level fence holds for them (a DRA
    /// `DeviceTaintRule`, or a device plugin that has withdrawn them), or
    /// the whole node.
    #[serde(default)]
    pub quarantine: Quarantine,

    /// How many nodes this policy may have cordoned for remediation at once:
    /// a count (at least 1) or a percentage of the selected nodes.
    #[serde(default = "default_max_concurrent")]
    #[schemars(schema_with = "max_concurrent_schema")]
    pub max_concurrent: IntOrString,

    /// The circuit breaker: when more selected nodes than this are unhealthy
    /// at once, something fleet-wide is wrong (a bad driver, a bad rollout), and
    /// no new remediation starts. A count or a percentage of the selected nodes.
    #[serde(default = "default_max_unhealthy")]
    #[schemars(schema_with = "max_unhealthy_schema")]
    pub max_unhealthy: IntOrString,

    /// How a node proves it is healthy again before it is uncordoned.
    #[serde(default)]
    pub verification: Verification,

    /// Other tools that disrupt nodes (the GPU Operator's driver upgrades,
    /// kured's reboots, Medik8s maintenance): while one of these signals is
    /// on a node, gpuhealth starts nothing disruptive there, and the node
    /// counts against `maxConcurrent`.
    #[serde(default = "default_other_actors")]
    #[schemars(length(max = 32))]
    pub other_actors: Vec<OtherActor>,

    /// Repeat offenders: how often one GPU or one node may be remediated in
    /// a rolling window before it is handed over for replacement, and the
    /// pause between two remediations of a node.
    #[serde(default)]
    pub remediation_limits: RemediationLimits,

    /// When steps that disrupt healthy GPUs may run (evicting pods that
    /// hold no bad GPU, reboots). Empty: at any time. A reset scoped to the
    /// broken GPU's own pods runs at once regardless.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub maintenance_windows: Vec<MaintenanceWindow>,

    /// Scheduled maintenance announced on a node (`gpuhealth.io/maintenance`).
    #[serde(default)]
    pub maintenance: Maintenance,
}

/// Where another tool's signal lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum SignalSource {
    /// A label of the Node (`key`).
    Label,
    /// An annotation of the Node (`key`).
    Annotation,
    /// A taint of the Node (`key`).
    Taint,
    /// kured's reboot lock: the annotation `key` on kured's DaemonSet
    /// (`object`, `namespace/name`) names the node (`"nodeID":"<node>"`).
    KuredLock,
    /// A Medik8s `NodeMaintenance` (API group `key`, version `v1beta1`)
    /// whose `spec.nodeName` is the node.
    NodeMaintenance,
}

/// A signal that another tool is disrupting a node.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OtherActor {
    /// Who it is, for messages: `gpu-operator`, `kured`, `medik8s`.
    #[schemars(length(min = 1, max = 63))]
    pub name: String,
    pub source: SignalSource,
    /// The label, annotation or taint key; for `KuredLock` the lock
    /// annotation; for `NodeMaintenance` the API group.
    #[schemars(length(min = 1, max = 316))]
    pub key: String,
    /// For `KuredLock`: kured's DaemonSet, as `namespace/name`
    /// (`kube-system/kured` when unset). The operator must be allowed to
    /// get it (the shipped RBAC allows DaemonSets named `kured`); while it
    /// cannot, the policy's `Ready` is False (`CannotHonour`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 3, max = 317))]
    pub object: Option<String>,
    /// Disrupting while the value is one of these; any value when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub values: Vec<String>,
    /// Not disrupting while the value is one of these.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub except_values: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RemediationLimits {
    /// The rolling window the counts below are over.
    #[serde(default = "default_limits_window")]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "duration(self) > duration('0s') && duration(self) <= duration('2160h')",
        "message": "remediationLimits.window must be more than 0s and at most 2160h (90 days)"
    }]))]
    pub window: Duration,
    /// Remediations of one GPU in the window; the next sends the node to
    /// `Failed` (`RepeatedFailures`), labelled `gpuhealth.io/needs-replacement=true`,
    /// instead of another one. 0: no limit.
    #[serde(default = "default_per_gpu")]
    #[schemars(range(max = 100))]
    pub per_gpu: u32,
    /// Remediations of one node in the window, whatever the GPU. 0: no limit.
    #[serde(default = "default_per_node")]
    #[schemars(range(max = 100))]
    pub per_node: u32,
    /// The least time from the end of one remediation of a node to the
    /// start of the next one's action; the node waits cordoned meanwhile.
    #[serde(default = "default_cooldown")]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "duration(self) >= duration('0s') && duration(self) <= duration('24h')",
        "message": "remediationLimits.cooldown must be from 0s to 24h"
    }]))]
    pub cooldown: Duration,
}

impl Default for RemediationLimits {
    fn default() -> Self {
        RemediationLimits {
            window: default_limits_window(),
            per_gpu: default_per_gpu(),
            per_node: default_per_node(),
            cooldown: default_cooldown(),
        }
    }
}

#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
pub enum Weekday {
    Mon,
    Tue,
    Wed,
    Thu,
    Fri,
    Sat,
    Sun,
}

/// A recurring window, e.g. weekdays 22:00 to 06:00 in Europe/Berlin. An end
/// at or before the start runs into the next day.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MaintenanceWindow {
    /// The days it starts on; every day when empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 7))]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    pub days: Vec<Weekday>,
    /// `HH:MM`, 24-hour.
    #[schemars(length(min = 5, max = 5))]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "self.matches('^([01][0-9]|2[0-3]):[0-5][0-9]$')",
        "message": "maintenanceWindows[].start must be HH:MM (24-hour)"
    }]))]
    pub start: String,
    /// `HH:MM`, 24-hour.
    #[schemars(length(min = 5, max = 5))]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "self.matches('^([01][0-9]|2[0-3]):[0-5][0-9]$')",
        "message": "maintenanceWindows[].end must be HH:MM (24-hour)"
    }]))]
    pub end: String,
    /// An IANA time zone (`Europe/Berlin`); `UTC` when unset. One the
    /// operator does not know keeps the window shut, and makes the policy's
    /// `Ready` False (`CannotHonour`).
    #[serde(default = "default_time_zone")]
    #[schemars(length(min = 1, max = 64))]
    pub time_zone: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Maintenance {
    /// Act on `gpuhealth.io/maintenance` notices.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// How long before the notice's deadline to cordon and drain the node,
    /// so that the provider finds it empty.
    #[serde(default = "default_lead_time")]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "duration(self) >= duration('0s') && duration(self) <= duration('720h')",
        "message": "maintenance.leadTime must be from 0s to 720h"
    }]))]
    pub lead_time: Duration,
    /// Whether a GPU that fails on a node with maintenance ahead is
    /// remediated first; by default the node goes straight to the
    /// maintenance drain, and the provider's work is its remediation.
    #[serde(default)]
    pub remediate_before: bool,
    /// How long past the deadline a drained node may wait for the provider
    /// before gpuhealth reports it overdue (it keeps waiting, cordoned).
    #[serde(default = "default_overdue_after")]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "duration(self) >= duration('0s') && duration(self) <= duration('720h')",
        "message": "maintenance.overdueAfter must be from 0s to 720h"
    }]))]
    pub overdue_after: Duration,
}

impl Default for Maintenance {
    fn default() -> Self {
        Maintenance {
            enabled: true,
            lead_time: default_lead_time(),
            remediate_before: false,
            overdue_after: default_overdue_after(),
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Mode {
    #[default]
    Enforce,
    DryRun,
    Paused,
}

/// The signals that make a node unhealthy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Detection {
    /// The per-GPU report in the node annotation `gpuhealth.io/gpus`.
    #[serde(default)]
    pub gpu_report: GpuReportDetection,

    /// Node conditions written by other detectors (node-problem-detector,
    /// NVSentinel's `SysLogsXIDError`, EKS's `AcceleratedHardwareReady`, ...).
    #[serde(default)]
    #[schemars(length(max = 32))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub node_conditions: Vec<ConditionRule>,

    /// Per-Xid actions that replace the built-in table.
    #[serde(default)]
    #[schemars(length(max = 256))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["xid"]))]
    pub xid_overrides: Vec<XidOverride>,

    /// Taints a DRA driver puts on a GPU's device in its ResourceSlice
    /// (NVIDIA's, with its health check on: `gpu.nvidia.com/xid`,
    /// `gpu.nvidia.com/gpu-lost`), each the signal of its GPU. Only taints
    /// added since the GPU's last remediation count: a driver that never
    /// lifts its own does not start a second one.
    #[serde(default = "default_device_taints")]
    #[schemars(length(max = 32))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["key"]))]
    pub device_taints: Vec<DeviceTaintSignal>,

    /// The kubelet's health of the devices it gave each pod
    /// (`allocatedResourcesStatus` in pod status, on by default since
    /// Kubernetes 1.36): a GPU it reports `Unhealthy` (the device plugin's
    /// `quarantine.devicePluginResource`, or a device of
    /// `quarantine.draDriver`) is that GPU's signal.
    #[serde(default)]
    pub pod_device_health: PodDeviceHealthSignal,
}

impl Default for Detection {
    fn default() -> Self {
        Detection {
            gpu_report: GpuReportDetection::default(),
            node_conditions: Vec::new(),
            xid_overrides: Vec::new(),
            device_taints: default_device_taints(),
            pod_device_health: PodDeviceHealthSignal::default(),
        }
    }
}

/// The kubelet's word that a GPU a pod holds is unhealthy, as a signal.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PodDeviceHealthSignal {
    /// The ladder rung it starts from; `Ignore` reads it not at all.
    #[serde(default = "default_pod_device_health_action")]
    pub action: SignalAction,
}

impl Default for PodDeviceHealthSignal {
    fn default() -> Self {
        PodDeviceHealthSignal {
            action: default_pod_device_health_action(),
        }
    }
}

fn default_pod_device_health_action() -> SignalAction {
    SignalAction::GpuReset
}

/// A device taint that is a signal.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeviceTaintSignal {
    /// The taint's key.
    #[schemars(length(min = 1, max = 316))]
    pub key: String,
    /// The ladder rung it starts from.
    pub action: SignalAction,
}

fn default_device_taints() -> Vec<DeviceTaintSignal> {
    vec![
        DeviceTaintSignal {
            key: "gpu.nvidia.com/xid".into(),
            action: SignalAction::GpuReset,
        },
        DeviceTaintSignal {
            key: "gpu.nvidia.com/gpu-lost".into(),
            action: SignalAction::NodeReboot,
        },
    ]
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "!self.enabled || size(self.unhealthyStates) > 0",
        "message": "detection.gpuReport.unhealthyStates must name at least one state while the report is enabled"
    },
    {
        "rule": "!self.unhealthyStates.exists(s, s == 'Healthy')",
        "message": "detection.gpuReport.unhealthyStates must not contain Healthy"
    }
]))]
pub struct GpuReportDetection {
    /// Read the `gpuhealth.io/gpus` annotation.
    #[serde(default = "default_true")]
    pub enabled: bool,

    /// GPU states that start a remediation. `Degraded` GPUs are only reported.
    #[serde(default = "default_unhealthy_states")]
    #[schemars(length(max = 4))]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    pub unhealthy_states: Vec<GpuHealth>,

    /// A report not refreshed for this long is stale: the node gets a
    /// `StaleReport` finding (and the `gpuhealth_report_problems` metric),
    /// and nothing is done because of it. gpuhealth's agent refreshes its
    /// report every 5 minutes. A node selected for this long with no report
    /// at all (counted from its creation, or from when the operator first
    /// saw it selected without one, whichever is later) gets a `NoReport`
    /// finding, its `GpuHealthy` condition `Unknown` under an `Enforce`
    /// policy, and the `gpuhealth_nodes_not_reporting` metric; its phase
    /// stays as it is.
    #[serde(default = "default_stale_after")]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "duration(self) >= duration('1m') && duration(self) <= duration('720h')",
        "message": "detection.gpuReport.staleAfter must be between 1m and 720h"
    }]))]
    pub stale_after: Duration,
}

impl Default for GpuReportDetection {
    fn default() -> Self {
        GpuReportDetection {
            enabled: true,
            unhealthy_states: default_unhealthy_states(),
            stale_after: default_stale_after(),
        }
    }
}

/// A node condition that marks the node unhealthy.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
// On the rule, not on `writers`: the API server checks a field's own rules
// against its default (none), and would refuse the CRD.
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "size(self.writers) > 0",
    "message": "detection.nodeConditions[].writers must name who may write the condition (its detector's identity)"
}]))]
pub struct ConditionRule {
    /// The condition type, e.g. `SysLogsXIDError`.
    #[schemars(length(min = 1, max = 316))]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "self.matches('^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\\\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$')",
        "message": "detection.nodeConditions[].type must be a condition type such as SysLogsXIDError"
    }, reserved_type_validation()]))]
    #[serde(rename = "type")]
    pub type_: String,

    /// The status that means unhealthy: `True` for most detectors, `False`
    /// for conditions named after health (`AcceleratedHardwareReady`).
    pub status: ConditionStatus,

    /// How long the condition must hold before it counts.
    #[serde(rename = "for", default = "default_condition_for")]
    pub for_: Duration,

    /// The ladder rung this condition starts from. A condition names no GPU,
    /// so `GpuReset` resets every GPU of the node.
    #[serde(default = "default_condition_action")]
    pub action: SignalAction,

    /// Who may write this condition: its detector's identity; at least one
    /// (a rule without is refused). Whoever may patch a Node's status could
    /// otherwise write it and get a real reset. The install's
    /// `gpuhealth-trusted-conditions` admission policy refuses it to anyone
    /// else on the nodes this policy selects, while it is in `Enforce` and
    /// the cluster's guardrail allows the type. The empty default only
    /// reads a rule stored before writers were required, which is not
    /// acted on.
    #[serde(default)]
    #[schemars(length(max = 16))]
    pub writers: Vec<ConditionWriter>,
}

/// Node condition types no policy may act on: the node lifecycle's own
/// (the kubelets write them; the node lifecycle controller taints and
/// evicts by them) and the agent's `GpuHealthy`. A rule's writers are the
/// only identities admission lets write its condition, so a rule on one of
/// these would refuse the kubelets' or the agent's own writes.
pub const RESERVED_CONDITION_TYPES: [&str; 6] = [
    "Ready",
    "MemoryPressure",
    "DiskPressure",
    "PIDPressure",
    "NetworkUnavailable",
    GPU_HEALTHY_CONDITION,
];

/// The CRD's rule refusing [`RESERVED_CONDITION_TYPES`], built from them.
fn reserved_type_validation() -> serde_json::Value {
    let quoted: Vec<String> = RESERVED_CONDITION_TYPES
        .iter()
        .map(|t| format!("'{t}'"))
        .collect();
    let (lifecycle, agent) = RESERVED_CONDITION_TYPES.split_at(5);
    serde_json::json!({
        "rule": format!("!(self in [{}])", quoted.join(", ")),
        "message": format!(
            "detection.nodeConditions[].type must not be {} (the node lifecycle's own conditions) \
             nor {} (gpuhealth's agent's own): only the policy's writers could then write it",
            lifecycle.join(", "),
            agent.join(", "),
        ),
    })
}

impl ConditionRule {
    /// Whether the operator acts on this rule: it names its writers, and
    /// its type is not reserved (a policy stored before the CRD refused
    /// either). `honour` names each rule that is not.
    pub fn acted_on(&self) -> bool {
        !self.writers.is_empty() && !self.reserved()
    }

    /// Whether its type is one of [`RESERVED_CONDITION_TYPES`].
    pub fn reserved(&self) -> bool {
        RESERVED_CONDITION_TYPES.contains(&self.type_.as_str())
    }
}

/// An identity that may write a node condition, as the API server
/// authenticates it: exactly one of `user` and `group`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "has(self.user) != has(self.group)",
    "message": "a writer is exactly one of user and group"
}]))]
pub struct ConditionWriter {
    /// A user name: a ServiceAccount's is
    /// `system:serviceaccount:NAMESPACE:NAME` (node-problem-detector's, say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub user: Option<String>,
    /// A group: `system:nodes` for the kubelets.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub group: Option<String>,
}

impl ConditionWriter {
    /// A ServiceAccount, by its user name.
    pub fn service_account(namespace: &str, name: &str) -> Self {
        ConditionWriter {
            user: Some(format!("system:serviceaccount:{namespace}:{name}")),
            group: None,
        }
    }

    /// Every member of `group`.
    pub fn group(group: &str) -> Self {
        ConditionWriter {
            user: None,
            group: Some(group.into()),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ConditionStatus {
    True,
    False,
    Unknown,
}

/// The action for one Xid code, replacing the built-in default.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct XidOverride {
    #[schemars(range(min = 1, max = 65535))]
    pub xid: u32,
    pub action: SignalAction,
}

/// One rung of the escalation ladder.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EscalationStep {
    pub action: RecoveryAction,

    /// How many times to try this rung before the next.
    #[serde(default = "default_attempts")]
    #[schemars(range(min = 1, max = 5))]
    pub attempts: u32,

    /// How long one attempt may take, from the request to a verified result.
    /// Defaults: 10m for `GpuReset`, 30m for `NodeReboot`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "duration(self) > duration('0s') && duration(self) <= duration('24h')",
        "message": "escalation[].timeout must be more than 0s and at most 24h"
    }]))]
    pub timeout: Option<Duration>,
}

impl EscalationStep {
    /// The timeout in force for this rung.
    pub fn effective_timeout(&self) -> Duration {
        self.timeout.unwrap_or(match self.action {
            RecoveryAction::GpuReset => Duration::from_mins(10),
            RecoveryAction::NodeReboot => Duration::from_mins(30),
            RecoveryAction::ReplaceNode => Duration::ZERO,
        })
    }
}

/// Which pods a drain evicts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum DrainScope {
    /// Only pods holding the bad GPUs: enough for a single-GPU reset.
    #[default]
    AffectedPods,
    /// Every pod that requests a GPU.
    GpuPods,
    /// Every pod but DaemonSet and mirror pods. A reboot always drains this wide.
    AllPods,
}

/// What happens when pods have not left by `drain.timeout`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum DrainTimeoutAction {
    /// Stop: the node stays cordoned and is marked `Failed` for a person.
    #[default]
    Fail,
    /// Delete the remaining pods (tolerance `never` excepted), bypassing their
    /// PodDisruptionBudgets. Only where the policy says so.
    ForceDelete,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "!has(self.gracePeriod) || duration(self.gracePeriod) < duration(self.timeout)",
    "message": "drain.gracePeriod must be shorter than drain.timeout"
}]))]
pub struct Drain {
    #[serde(default)]
    pub scope: DrainScope,

    /// Termination grace for evicted pods; unset keeps each pod's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grace_period: Option<Duration>,

    /// How long pods may take to leave, including `wait` pods finishing.
    #[serde(default = "default_drain_timeout")]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "duration(self) > duration('0s')",
        "message": "drain.timeout must be more than 0s"
    }]))]
    pub timeout: Duration,

    #[serde(default)]
    pub on_timeout: DrainTimeoutAction,

    /// Namespaces whose pods are never evicted; one that holds a GPU the
    /// step acts on holds the step back.
    #[serde(default)]
    #[schemars(length(max = 64))]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    pub exclude_namespaces: Vec<String>,

    /// Pods matching this selector are never evicted; one that holds a GPU
    /// the step acts on holds the step back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exclude_pod_selector: Option<LabelSelector>,

    /// Pods that run as one of a gang (a JobSet, a LeaderWorkerSet group,
    /// a PodGroup, a Kueue, Volcano or KAI pod group, or the label the
    /// policy names) and how they leave.
    #[serde(default)]
    pub gangs: GangDrain,
}

impl Default for Drain {
    fn default() -> Self {
        Drain {
            scope: DrainScope::default(),
            grace_period: None,
            timeout: default_drain_timeout(),
            on_timeout: DrainTimeoutAction::default(),
            exclude_namespaces: Vec::new(),
            exclude_pod_selector: None,
            gangs: GangDrain::default(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "duration(self.stableFor) < duration(self.timeout)",
    "message": "verification.stableFor must be shorter than verification.timeout"
}]))]
pub struct Verification {
    /// How long every signal must stay clear before the node is uncordoned.
    #[serde(default = "default_stable_for")]
    pub stable_for: Duration,

    /// How long to wait for signals to clear after an action before the
    /// attempt counts as failed.
    #[serde(default = "default_verification_timeout")]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "duration(self) > duration('0s')",
        "message": "verification.timeout must be more than 0s"
    }]))]
    pub timeout: Duration,

    /// A pod run on the node (pinned to it, tolerating the quarantine) that
    /// must succeed before uncordon, e.g. a short CUDA or NCCL test.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub validation_pod: Option<ValidationPod>,

    /// DCGM's diagnostic, run by the node's executor on the repaired GPUs
    /// once signals have stayed clear and before the validation pod. A
    /// diagnostic that fails, times out or cannot run is a failed attempt
    /// (the next rung), never an uncordon.
    #[serde(default)]
    pub diagnostics: Diagnostics,

    /// How long after uncordon the workloads whose pods were evicted have
    /// to be Ready again, wherever they were rescheduled. If they are not,
    /// the incident records `WorkloadNotRecovered` with the cause (a startup
    /// probe too short for the cold start, a crash, an OOM kill, a GPU
    /// error), separate from the hardware's recovery. Long enough for the
    /// slowest cold start; `0s` turns the check off.
    #[serde(default = "default_workload_recovery_timeout")]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "duration(self) >= duration('0s') && duration(self) <= duration('24h')",
        "message": "verification.workloadRecoveryTimeout must be from 0s to 24h"
    }]))]
    pub workload_recovery_timeout: Duration,
}

impl Default for Verification {
    fn default() -> Self {
        Verification {
            stable_for: default_stable_for(),
            timeout: default_verification_timeout(),
            validation_pod: None,
            diagnostics: Diagnostics::default(),
            workload_recovery_timeout: default_workload_recovery_timeout(),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Diagnostics {
    /// `None` (the default), `Quick` (DCGM level 1, seconds) or `Medium`
    /// (DCGM level 2, about two minutes).
    #[serde(default)]
    pub level: DiagnosticsLevel,

    /// How long the diagnostic may take, from its request to the executor's
    /// answer; past it the attempt has failed.
    #[serde(default = "default_diagnostics_timeout")]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "duration(self) >= duration('10s') && duration(self) <= duration('1h')",
        "message": "verification.diagnostics.timeout must be from 10s to 1h"
    }]))]
    pub timeout: Duration,
}

impl Default for Diagnostics {
    fn default() -> Self {
        Diagnostics {
            level: DiagnosticsLevel::None,
            timeout: default_diagnostics_timeout(),
        }
    }
}

fn default_diagnostics_timeout() -> Duration {
    Duration::from_mins(10)
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ValidationPod {
    /// A pod template (`metadata` and `spec`). It runs in gpuhealth's
    /// validation namespace (`restricted` Pod Security) as a ServiceAccount
    /// with no token: host namespaces, host paths, privilege, added
    /// capabilities, host ports, a ServiceAccount or a namespace are refused.
    /// Checked again by the operator when it runs it; an invalid template
    /// fails verification with a clear reason.
    #[schemars(schema_with = "pod_template_schema")]
    pub template: serde_json::Value,

    /// How long the pod may take to succeed.
    #[serde(default = "default_validation_timeout")]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "duration(self) > duration('0s')",
        "message": "verification.validationPod.timeout must be more than 0s"
    }]))]
    pub timeout: Duration,
}

fn max_concurrent_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "description": "How many nodes this policy may have cordoned for remediation at once: a count (at least 1) or a percentage of the selected nodes.",
        "default": 1,
        "nullable": false,
        "x-kubernetes-int-or-string": true,
        "x-kubernetes-validations": [{
            "rule": "type(self) == int ? self >= 1 : self.matches('^([1-9][0-9]?|100)%$')",
            "message": "maxConcurrent must be a count of at least 1 or a percentage from 1% to 100%"
        }]
    })
}

fn max_unhealthy_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "description": "The circuit breaker: when more selected nodes than this are unhealthy at once, no new remediation starts. A count or a percentage of the selected nodes.",
        "default": "25%",
        "nullable": false,
        "x-kubernetes-int-or-string": true,
        "x-kubernetes-validations": [{
            "rule": "type(self) == int ? self >= 0 : self.matches('^([0-9]|[1-9][0-9]|100)%$')",
            "message": "maxUnhealthy must be a count of at least 0 or a percentage from 0% to 100%"
        }]
    })
}

/// A loose schema for the validation pod template: embedding the full PodSpec
/// schema would make the CRD hundreds of kilobytes; the API server still
/// checks the shape we rely on. What would give the pod the node (host
/// namespaces, host paths, privilege, added capabilities, host ports), GPUs
/// it was not allocated (a runtime class, `NVIDIA_VISIBLE_DEVICES`) or
/// another identity (a ServiceAccount, a token mounted or projected, a
/// namespace) is refused here, by field; the operator checks again before
/// it creates the pod.
fn pod_template_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let open_object =
        serde_json::json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true});
    let never_true = serde_json::json!({"type": "boolean", "enum": [false]});
    let container = serde_json::json!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true,
        "properties": {
            "securityContext": {
                "type": "object",
                "x-kubernetes-preserve-unknown-fields": true,
                "properties": {
                    "privileged": never_true,
                    "allowPrivilegeEscalation": never_true,
                    "capabilities": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": true,
                        "properties": {
                            "add": {"type": "array", "maxItems": 0, "items": {"type": "string"}}
                        }
                    }
                }
            },
            "ports": {
                "type": "array",
                "maxItems": 64,
                "items": {
                    "type": "object",
                    "x-kubernetes-preserve-unknown-fields": true,
                    "properties": {"hostPort": {"type": "integer", "enum": [0]}}
                }
            },
            "env": {
                "type": "array",
                "maxItems": 128,
                "items": {
                    "type": "object",
                    "x-kubernetes-preserve-unknown-fields": true,
                    "properties": {"name": {"type": "string", "maxLength": 256}},
                    "x-kubernetes-validations": [{
                        "rule": "!has(self.name) || self.name != 'NVIDIA_VISIBLE_DEVICES'",
                        "fieldPath": ".name",
                        "message": "may not be NVIDIA_VISIBLE_DEVICES: a validation pod sees only the GPUs it is allocated"
                    }]
                }
            }
        }
    });
    let token_source = serde_json::json!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true,
        "properties": {"serviceAccountToken": open_object},
        "x-kubernetes-validations": [{
            "rule": "!has(self.serviceAccountToken)",
            "fieldPath": ".serviceAccountToken",
            "message": "may not be set: validation pods run with no token"
        }]
    });
    schemars::json_schema!({
        "type": "object",
        "required": ["spec"],
        "properties": {
            "metadata": {
                "type": "object",
                "x-kubernetes-preserve-unknown-fields": true,
                "properties": {"namespace": {"type": "string"}},
                "x-kubernetes-validations": [{
                    "rule": "!has(self.__namespace__)",
                    "fieldPath": ".namespace",
                    "message": "may not be set: validation pods run in gpuhealth's validation namespace"
                }]
            },
            "spec": {
                "type": "object",
                "x-kubernetes-preserve-unknown-fields": true,
                "required": ["containers"],
                "x-kubernetes-validations": [{
                    "rule": "!has(self.serviceAccountName)",
                    "fieldPath": ".serviceAccountName",
                    "message": "may not be set: validation pods run as gpuhealth's validation ServiceAccount, with no token"
                }, {
                    "rule": "!has(self.serviceAccount)",
                    "fieldPath": ".serviceAccount",
                    "message": "may not be set: validation pods run as gpuhealth's validation ServiceAccount, with no token"
                }, {
                    "rule": "!has(self.runtimeClassName)",
                    "fieldPath": ".runtimeClassName",
                    "message": "may not be set: a GPU runtime class can hand a validation pod every GPU of the node; it gets the GPUs it requests"
                }],
                "properties": {
                    "serviceAccountName": {"type": "string"},
                    "serviceAccount": {"type": "string"},
                    "runtimeClassName": {"type": "string"},
                    "hostNetwork": never_true,
                    "hostPID": never_true,
                    "hostIPC": never_true,
                    "automountServiceAccountToken": never_true,
                    "volumes": {
                        "type": "array",
                        "maxItems": 64,
                        "items": {
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": true,
                            "properties": {
                                "hostPath": open_object,
                                "projected": {
                                    "type": "object",
                                    "x-kubernetes-preserve-unknown-fields": true,
                                    "properties": {
                                        "sources": {"type": "array", "maxItems": 64, "items": token_source}
                                    }
                                }
                            },
                            "x-kubernetes-validations": [{
                                "rule": "!has(self.hostPath)",
                                "fieldPath": ".hostPath",
                                "message": "may not be set: a validation pod may not mount a host path"
                            }]
                        }
                    },
                    "initContainers": {"type": "array", "maxItems": 16, "items": container},
                    "containers": {"type": "array", "minItems": 1, "maxItems": 16, "items": container},
                    "ephemeralContainers": {"type": "array", "maxItems": 0, "items": open_object}
                }
            }
        }
    })
}

/// The policy's view of its fleet, written by the operator.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuHealthPolicyStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// Nodes this policy manages.
    #[serde(default)]
    pub nodes: u32,
    #[serde(default)]
    pub healthy: u32,
    /// Nodes between `Suspect` and `Verifying`.
    #[serde(default)]
    pub remediating: u32,
    #[serde(default)]
    pub failed: u32,
    /// `Ready`, `CircuitOpen`, `Conflict`. `Ready` is False with reason
    /// `InvalidSelector` when the selector cannot be used, or `CannotHonour`
    /// while a field cannot be honoured as written (an unknown time zone, a
    /// lock the operator may not read); its message names each field.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

impl GpuHealthPolicyStatus {
    /// The condition of `type_`, if the status carries it.
    pub fn condition(&self, type_: PolicyCondition) -> Option<&Condition> {
        self.conditions.iter().find(|c| c.type_ == type_.as_str())
    }

    /// Whether the condition of `type_` is `True`.
    pub fn is_true(&self, type_: PolicyCondition) -> bool {
        self.condition(type_).is_some_and(|c| c.status == "True")
    }
}

fn default_true() -> bool {
    true
}
fn default_unhealthy_states() -> Vec<GpuHealth> {
    vec![
        GpuHealth::ResetRequired,
        GpuHealth::RebootRequired,
        GpuHealth::Lost,
    ]
}
fn default_stale_after() -> Duration {
    Duration::from_mins(15)
}
fn default_condition_for() -> Duration {
    Duration::from_secs(30)
}
fn default_condition_action() -> SignalAction {
    SignalAction::NodeReboot
}
fn default_attempts() -> u32 {
    1
}
fn default_escalation() -> Vec<EscalationStep> {
    vec![
        EscalationStep {
            action: RecoveryAction::GpuReset,
            attempts: 1,
            timeout: None,
        },
        EscalationStep {
            action: RecoveryAction::NodeReboot,
            attempts: 1,
            timeout: None,
        },
    ]
}
fn default_drain_timeout() -> Duration {
    Duration::from_mins(15)
}
fn default_max_concurrent() -> IntOrString {
    IntOrString::Int(1)
}
fn default_max_unhealthy() -> IntOrString {
    IntOrString::String("25%".into())
}
fn default_stable_for() -> Duration {
    Duration::from_mins(2)
}
fn default_verification_timeout() -> Duration {
    Duration::from_mins(10)
}
/// The three tools a GPU fleet usually runs beside gpuhealth, each by
/// what it writes: the GPU Operator's upgrade state label; kured's lock
/// (and the node annotation it sets with `--annotate-nodes`); a Medik8s
/// `NodeMaintenance` (and the taint its operator sets).
pub fn default_other_actors() -> Vec<OtherActor> {
    let actor = |name: &str, source, key: &str| OtherActor {
        name: name.into(),
        source,
        key: key.into(),
        object: None,
        values: Vec::new(),
        except_values: Vec::new(),
    };
    vec![
        OtherActor {
            except_values: vec!["upgrade-done".into()],
            ..actor(
                "gpu-operator",
                SignalSource::Label,
                "nvidia.com/gpu-driver-upgrade-state",
            )
        },
        OtherActor {
            object: Some("kube-system/kured".into()),
            ..actor(
                "kured",
                SignalSource::KuredLock,
                "weave.works/kured-node-lock",
            )
        },
        actor(
            "kured",
            SignalSource::Annotation,
            "weave.works/kured-reboot-in-progress",
        ),
        actor(
            "medik8s",
            SignalSource::NodeMaintenance,
            "nodemaintenance.medik8s.io",
        ),
        actor("medik8s", SignalSource::Taint, "medik8s.io/drain"),
    ]
}
fn default_limits_window() -> Duration {
    Duration::from_hours(24)
}
fn default_per_gpu() -> u32 {
    2
}
fn default_per_node() -> u32 {
    4
}
fn default_cooldown() -> Duration {
    Duration::from_mins(10)
}
fn default_time_zone() -> String {
    "UTC".into()
}
fn default_lead_time() -> Duration {
    Duration::from_hours(2)
}
fn default_overdue_after() -> Duration {
    Duration::from_hours(1)
}
fn default_workload_recovery_timeout() -> Duration {
    Duration::from_mins(30)
}
fn default_validation_timeout() -> Duration {
    Duration::from_mins(10)
}

impl GpuHealthPolicySpec {
    /// A policy with only a node selector, everything else defaulted: what
    /// the API server stores for `spec: {nodeSelector: ...}`.
    pub fn for_selector(node_selector: LabelSelector) -> Self {
        GpuHealthPolicySpec {
            node_selector,
            mode: Mode::default(),
            acknowledge_fleet_wide: false,
            priority: 0,
            detection: Detection::default(),
            escalation: default_escalation(),
            drain: Drain::default(),
            quarantine: Quarantine::default(),
            max_concurrent: default_max_concurrent(),
            max_unhealthy: default_max_unhealthy(),
            verification: Verification::default(),
            other_actors: default_other_actors(),
            remediation_limits: RemediationLimits::default(),
            maintenance_windows: Vec::new(),
            maintenance: Maintenance::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(type_: &str, writers: Vec<ConditionWriter>) -> ConditionRule {
        ConditionRule {
            type_: type_.into(),
            status: ConditionStatus::True,
            for_: default_condition_for(),
            action: default_condition_action(),
            writers,
        }
    }

    /// The rules the CRD puts on `detection.nodeConditions[].type`.
    fn type_rules() -> Vec<serde_json::Value> {
        let crd = serde_json::to_value(crate::crds::all()[0].clone()).expect("crd");
        let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        let type_ = &spec["properties"]["detection"]["properties"]["nodeConditions"]["items"]["properties"]
            ["type"];
        type_["x-kubernetes-validations"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    #[test]
    fn the_crd_refuses_each_reserved_condition_type_by_its_field() {
        let rules = type_rules();
        let reserved = rules
            .iter()
            .find(|r| {
                r["rule"]
                    .as_str()
                    .is_some_and(|r| r.starts_with("!(self in ["))
            })
            .unwrap_or_else(|| panic!("no rule refuses reserved types: {rules:?}"));
        let (rule, message) = (
            reserved["rule"].as_str().unwrap_or_default(),
            reserved["message"].as_str().unwrap_or_default(),
        );
        assert_eq!(
            rule,
            "!(self in ['Ready', 'MemoryPressure', 'DiskPressure', 'PIDPressure', \
             'NetworkUnavailable', 'GpuHealthy'])"
        );
        assert!(
            message.starts_with("detection.nodeConditions[].type must not be Ready,"),
            "{message}"
        );
        for t in RESERVED_CONDITION_TYPES {
            assert!(message.contains(t), "{message} names {t}");
        }
    }

    #[test]
    fn a_rule_is_acted_on_only_with_writers_and_a_type_of_its_own() {
        let npd = || vec![ConditionWriter::service_account("npd", "npd")];
        assert!(rule("SysLogsXIDError", npd()).acted_on());
        assert!(!rule("SysLogsXIDError", Vec::new()).acted_on());
        for t in RESERVED_CONDITION_TYPES {
            assert!(rule(t, npd()).reserved(), "{t}");
            assert!(!rule(t, npd()).acted_on(), "{t}");
        }
        // Condition types are case-sensitive: only the lifecycle's own are.
        assert!(!rule("ready", npd()).reserved());
    }
}
