//! What a step did or noticed, beside the status it writes: said (in
//! Events and metrics), never acted on. The operator maps each to its
//! Event and counters, so that nothing downstream diffs two statuses or
//! reads a status's words back.

use std::time::Duration;

use gpuhealth_api::{
    gang::GangKey,
    node_health::Phase,
    vocabulary::{Attempt, FindingKind, IncidentOutcome, PodKey, Reason},
};
use k8s_openapi::jiff::Timestamp;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Happening {
    /// The node entered `phase`, or stayed in it for a new reason. Never
    /// said of `Healthy`: `Closed` says that.
    Entered {
        phase: Phase,
        reason: Reason,
        message: String,
    },
    /// A finding was recorded (new, or its message changed).
    Found {
        kind: FindingKind,
        message: String,
        /// The pod it is about, if it is about one.
        pod: Option<PodKey>,
    },
    /// An attempt ended and is on the incident's record.
    Attempted(Attempt),
    /// The attempt in flight failed, and the ladder goes on: why.
    AttemptFailed { why: String },
    /// The incident ended.
    Closed {
        outcome: IncidentOutcome,
        /// From its first signal to its end.
        lasted: Duration,
        message: String,
    },
    /// Every member of a gang was told it leaves with its gang at `at`.
    GangTold {
        gang: GangKey,
        members: u32,
        at: Timestamp,
    },
    /// Every member of a gang was deleted together.
    GangEvicted {
        gang: GangKey,
        members: u32,
        nodes: u32,
    },
    /// Every workload the last incident evicted is serving again.
    WorkloadsRecovered { message: String },
    /// Quarantined (the node cordoned, or its bad GPUs fenced) for a GPU
    /// report that shows a bad GPU, observed then: how long the reaction took.
    QuarantinedForReport { observed_at: Timestamp },
    /// A per-GPU quarantine ended (lifted, or widened to the node): `fenced`
    /// GPUs were kept from new work for `lasted` while `serving` others of
    /// the node went on taking it.
    GpuFenceEnded {
        fenced: u32,
        serving: u32,
        lasted: Duration,
    },
}
