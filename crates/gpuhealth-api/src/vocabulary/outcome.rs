//! How an incident, and the watch on its evicted workloads, ended.

use super::words;

words! {
    /// How an incident ended: `status.history[].outcome`.
    pub enum IncidentOutcome {
        /// The node is back in service (or would be, but someone else cordoned it).
        Recovered,
        /// Left cordoned for a person: escalation exhausted, a drain that
        /// timed out, a repeat offender, a replacement, or break glass.
        Failed,
        /// The maintenance notice it drained for was withdrawn.
        Cancelled,
    }
}

words! {
    /// Whether the workloads an incident evicted serve again:
    /// `status.history[].workloads.outcome`.
    pub enum WorkloadOutcome {
        /// Every one is Ready again.
        Recovered,
        /// Not every one was Ready by the deadline.
        WorkloadNotRecovered,
        /// A new incident began before the deadline: not judged.
        Superseded,
    }
}
