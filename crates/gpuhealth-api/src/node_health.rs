//! `GpuNodeHealth`: one per managed node, named after it and owned by it. It
//! has no spec to speak of; its status is where the operator records what it
//! sees, what it intends and what it did (intent before each side effect).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{
    contract::{RequestId, XidEvent},
    gang::GangRecord,
    quarantine::{Fenced, QuarantineStatus},
    types::{GpuHealth, RecoveryAction},
    vocabulary::{
        Attempt, FindingKind, FindingSubject, IncidentOutcome, PodKey, QuarantineWhy, Reason,
        WorkloadOutcome,
    },
};

/// How many past incidents a node keeps in `status.history`.
pub const HISTORY_LIMIT: usize = 20;
/// How many findings a node keeps in `status.findings`.
pub const FINDINGS_LIMIT: usize = 50;

/// The health of one managed GPU node. Written by the operator only.
// Columns: what fits 80 columns in `kubectl get gpuhealth`, where each name
// carries its kind and group; the rest (priority 1) with `-o wide`.
// Each printcolumn(...) repeats the same keys, which clippy mistakes for
// duplicated attributes.
#[allow(clippy::duplicated_attributes)]
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "gpuhealth.io",
    version = "v1alpha1",
    kind = "GpuNodeHealth",
    shortname = "gnh",
    category = "gpuhealth",
    status = "GpuNodeHealthStatus",
    doc = "The health of one managed GPU node, named after it: phase, GPUs, the action in flight, findings and history.",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(
        name = "Policy",
        type_ = "string",
        json_path = ".status.policy",
        priority = 1
    ),
    printcolumn(
        name = "Bad-GPUs",
        type_ = "integer",
        json_path = ".status.badGpus",
        priority = 1
    ),
    printcolumn(
        name = "Action",
        type_ = "string",
        json_path = ".status.action.type",
        priority = 1
    ),
    printcolumn(
        name = "Attempt",
        type_ = "integer",
        json_path = ".status.action.attempt",
        priority = 1
    ),
    printcolumn(
        name = "Fenced",
        type_ = "string",
        json_path = ".status.quarantine.scope"
    ),
    printcolumn(name = "Reason", type_ = "string", json_path = ".status.reason"),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
pub struct GpuNodeHealthSpec {}

/// Where a node is on its way from first signal back to serving.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum Phase {
    #[default]
    Healthy,
    /// A signal is present but has not held for its `for` duration yet.
    Suspect,
    /// Cordoned: no new pods land here.
    Quarantined,
    /// Pods are leaving per the policy's drain rules.
    Draining,
    /// A recovery action is in flight.
    Remediating,
    /// Drained ahead of a scheduled maintenance; waiting for the provider
    /// to do its work (the node's boot id changes).
    AwaitingMaintenance,
    /// The action finished; waiting for signals to stay clear (and the
    /// validation pod, if any) before uncordon.
    Verifying,
    /// Escalation exhausted or the drain timed out: stays cordoned for a person.
    Failed,
}

impl Phase {
    /// Every phase, in the order a node goes through them; `Failed` last.
    pub const ALL: [Phase; 8] = [
        Phase::Healthy,
        Phase::Suspect,
        Phase::Quarantined,
        Phase::Draining,
        Phase::Remediating,
        Phase::AwaitingMaintenance,
        Phase::Verifying,
        Phase::Failed,
    ];
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuNodeHealthStatus {
    #[serde(default)]
    pub phase: Phase,
    /// The policy managing this node.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
    /// When the node entered its current phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase_since: Option<Time>,
    /// Why the node is where it is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<Reason>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Count of GPUs not serving; kept for the printer column.
    #[serde(default)]
    pub bad_gpus: u32,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub gpus: Vec<GpuStatus>,
    /// The recovery action in flight, recorded before it is requested.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<ActionStatus>,
    /// The current incident, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incident: Option<String>,
    /// What the incident took out of service (the node, or its bad GPUs),
    /// and why that much.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quarantine: Option<QuarantineStatus>,
    /// The node's boot id when the current reboot was requested.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id_before_reboot: Option<String>,
    /// While verifying: since when every signal has been clear.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clear_since: Option<Time>,
    /// Other tools disrupting the node now (driver upgrade, reboot,
    /// maintenance), per the policy's `otherActors`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub disrupted_by: Vec<String>,
    /// The scheduled maintenance the current incident drains for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub maintenance: Option<MaintenanceStatus>,
    /// In `DryRun` mode: what gpuhealth would do now.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plan: Option<Plan>,
    /// Why the node's GPU report cannot be trusted now, if it cannot: it is
    /// stale, its writer says it cannot read the GPUs, or there is none.
    /// Nothing it says is taken as a recovery while this holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub report_problem: Option<ReportProblem>,
    /// What gpuhealth noticed that a person should know (a pod on a bad GPU,
    /// a startup probe shorter than the observed cold start, ...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 50))]
    pub findings: Vec<Finding>,
    /// Past incidents, newest first, at most `HISTORY_LIMIT`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 20))]
    pub history: Vec<Incident>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// The operator's seal over what is under way (the phase, the
    /// incident, the action in flight, the quarantine, the boot awaited,
    /// the maintenance): a keyed hash only it can make, so that it never
    /// carries out a record someone else wrote. Unset while nothing is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 128))]
    pub seal: Option<String>,
}

impl GpuNodeHealthStatus {
    /// The findings still worth a look. Findings stay until they are
    /// replaced, so: only those since the node's latest incident began (it
    /// answered the older ones), and none about a bad GPU once no GPU of
    /// the node is bad.
    pub fn open_findings(&self) -> impl Iterator<Item = &Finding> {
        let since = self.history.first().map(|i| i.started_at.0);
        let bad_gpu = self.bad_gpus > 0 || self.gpus.iter().any(|g| !g.health.is_serving());
        self.findings.iter().filter(move |f| {
            since.is_none_or(|t| f.observed_at.0 >= t) && (bad_gpu || !f.type_.about_a_bad_gpu())
        })
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuStatus {
    pub index: u32,
    pub uuid: String,
    pub pci_bus_id: String,
    pub health: GpuHealth,
    /// Pods holding this GPU.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pods: Vec<PodKey>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ActionStatus {
    /// The request id carried by the node annotation, so a restarted operator
    /// recognises its own request and never repeats it.
    pub id: RequestId,
    #[serde(rename = "type")]
    pub type_: RecoveryAction,
    /// 1-based attempt of this rung.
    pub attempt: u32,
    /// GPU UUIDs the action targets (empty: the whole node).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<String>,
    /// When this attempt was decided (its drain starts then).
    pub started_at: Time,
    /// When the request went to the node; unset while draining.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_at: Option<Time>,
    /// When the attempt times out, counted from the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<Time>,
}

/// What a `DryRun` policy would do on this node now.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Plan {
    /// Whether it would cordon the node (false when someone else already
    /// has, or when it would fence the bad GPUs alone).
    pub cordon: bool,
    /// What it would take out of service, and why that much.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quarantine: Option<PlannedQuarantine>,
    /// The recovery action it would take first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub action: Option<RecoveryAction>,
    /// GPU UUIDs the action would target (empty: the whole node).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<String>,
    /// Pods it would evict.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub evict: Vec<PodKey>,
    /// Pods it would wait for.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub wait_for: Vec<PodKey>,
    /// Pods that would hold the node back, with why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub blocked_by: Vec<String>,
    /// What the PodDisruptionBudgets of those pods allow now.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub disruption_budgets: Vec<String>,
    /// Why the drain takes more pods than those holding the GPUs, when it
    /// does (who holds them is not known).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub widened: Option<String>,
    /// Rungs of the ladder passed over because the node's agent cannot carry
    /// them out, with why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub skipped: Vec<String>,
    /// The gangs of the pods it would evict, and what would become of each
    /// (`drain.gangs`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gangs: Vec<String>,
}

/// What a `DryRun` policy would take out of service.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PlannedQuarantine {
    pub scope: Fenced,
    pub why: QuarantineWhy,
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReportProblem {
    pub kind: ReportProblemKind,
    pub message: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ReportProblemKind {
    /// Not refreshed within `detection.gpuReport.staleAfter`: its writer may
    /// have stopped.
    Stale,
    /// Its writer says it cannot read the GPUs (`unreadable`).
    Unreadable,
    /// There is none: the node has been selected for longer than
    /// `detection.gpuReport.staleAfter` and nothing has reported its GPUs.
    Missing,
}

impl ReportProblemKind {
    pub const ALL: [ReportProblemKind; 3] = [
        ReportProblemKind::Stale,
        ReportProblemKind::Unreadable,
        ReportProblemKind::Missing,
    ];
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Finding {
    #[serde(rename = "type")]
    pub type_: FindingKind,
    /// The object concerned: a pod (`ml/vllm-0`), a workload
    /// (`Deployment/ml/vllm`), an incident (`incident/<id>`), or who gave a
    /// maintenance notice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(with = "Option<String>")]
    pub subject: Option<FindingSubject>,
    pub message: String,
    pub observed_at: Time,
}

/// A signal that held when an incident opened.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OpeningSignal {
    pub reason: Reason,
    /// The GPU's UUID, if the signal is about one GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
    /// The Xid, as the GPU report showed it, if the signal is an Xid.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xid: Option<XidEvent>,
    /// In words, with the Xid's text as the driver wrote it.
    pub message: String,
}

/// At most this many signals are kept on an incident.
pub const OPENING_SIGNALS_LIMIT: usize = 8;

// Read through `IncidentRecord`, which also reads what release 0.1 wrote.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", from = "IncidentRecord")]
pub struct Incident {
    pub id: String,
    pub started_at: Time,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at: Option<Time>,
    /// What started it, e.g. `Xid 119 on GPU-...`.
    pub trigger: String,
    /// Every signal that held when it opened (each Xid with its code and
    /// text, a GPU's state, a node condition), strongest first: the
    /// incident is told whole after the report has moved on.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub signals: Vec<OpeningSignal>,
    /// What it tried, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attempts: Vec<Attempt>,
    /// Entries in words, as release 0.1 wrote its attempts, that this
    /// release cannot read as attempts: kept as they were, never added to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub actions: Vec<String>,
    /// Unset while open.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<IncidentOutcome>,
    /// The GPUs it was about (UUIDs; empty: the whole node), for the
    /// repeat-offender counts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub gpus: Vec<String>,
    /// The deadline of the maintenance notice it handled, if that is what it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub maintenance_deadline: Option<Time>,
    /// The workloads whose pods this incident evicted, and whether they
    /// came back after the node did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub workloads: Option<WorkloadRecovery>,
    /// The gangs whose members held the GPUs it acted on, and how they left.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    pub gangs: Vec<GangRecord>,
}

/// A scheduled maintenance being handled.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MaintenanceStatus {
    pub deadline: Time,
    pub source: String,
    pub reason: String,
    /// When the node was empty and left to the provider.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drained_at: Option<Time>,
}

/// Whether the workloads an incident evicted are serving again: the
/// hardware can recover while its workloads do not.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadRecovery {
    /// The controllers of the evicted pods, as `Kind/namespace/name`
    /// (`ReplicaSet/ml/vllm-7d9f6`, `StatefulSet/ml/trainer`).
    #[schemars(length(max = 64))]
    pub evicted: Vec<String>,
    /// Until when they may take to be Ready again; set at uncordon.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline: Option<Time>,
    /// Unset while watched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub outcome: Option<WorkloadOutcome>,
    /// What was seen, in plain words: which pods are not Ready and why.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// At most this many workloads are tracked per incident.
pub const WORKLOADS_LIMIT: usize = 64;

/// One incident, from its first signal to its end. Read as stored: what
/// this release writes, or what release 0.1 wrote (its attempts in words,
/// in `actions`).
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
struct IncidentRecord {
    id: String,
    started_at: Time,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ended_at: Option<Time>,
    /// What started it, e.g. `Xid 119 on GPU-...`.
    trigger: String,
    /// Every signal that held when it opened (each Xid with its code and
    /// text, a GPU's state, a node condition), strongest first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 8))]
    signals: Vec<OpeningSignal>,
    /// What it tried, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    attempts: Vec<Attempt>,
    /// Entries in words, as release 0.1 wrote its attempts (`GpuReset#1
    /// Failed`); read into `attempts`, and kept here only when they cannot be.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    actions: Vec<String>,
    /// Unset while open.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    outcome: Option<IncidentOutcome>,
    /// The GPUs it was about (UUIDs; empty: the whole node), for the
    /// repeat-offender counts.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    gpus: Vec<String>,
    /// The deadline of the maintenance notice it handled, if that is what it was.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    maintenance_deadline: Option<Time>,
    /// The workloads whose pods this incident evicted, and whether they
    /// came back after the node did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    workloads: Option<WorkloadRecovery>,
    #[serde(default)]
    gangs: Vec<GangRecord>,
}

impl Incident {
    /// Whether application Xids alone opened it (repeats across
    /// workloads): a tenant's code may be behind those, so such an
    /// incident never hands the node over for replacement and is not
    /// counted toward the remediation limits.
    pub fn opened_by_app_faults_alone(&self) -> bool {
        !self.signals.is_empty()
            && self
                .signals
                .iter()
                .all(|s| s.reason == crate::vocabulary::Reason::RepeatedAppXids)
    }
}

impl From<IncidentRecord> for Incident {
    fn from(r: IncidentRecord) -> Self {
        let mut attempts = Vec::new();
        let mut unread = Vec::new();
        let mut rung_attempt = 1;
        for entry in r.actions {
            match Attempt::from_words(&entry, rung_attempt) {
                Some(a) => {
                    if a.action.rung().is_some() {
                        rung_attempt = a.attempt;
                    }
                    attempts.push(a);
                }
                None => unread.push(entry),
            }
        }
        attempts.extend(r.attempts);
        Incident {
            id: r.id,
            started_at: r.started_at,
            ended_at: r.ended_at,
            trigger: r.trigger,
            signals: r.signals,
            attempts,
            actions: unread,
            outcome: r.outcome,
            gpus: r.gpus,
            maintenance_deadline: r.maintenance_deadline,
            workloads: r.workloads,
            gangs: r.gangs,
        }
    }
}
