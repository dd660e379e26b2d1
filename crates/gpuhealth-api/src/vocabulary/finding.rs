//! What gpuhealth noticed that a person should know: `status.findings[].type`.

use super::words;

words! {
    /// The kind of a finding; each is also the reason of its Warning Event
    /// and a value of `gpuhealth_findings_total{finding}`.
    pub enum FindingKind {
        /// A pod holds a GPU that is not serving; it may still look Ready.
        PodOnBadGpu,
        /// A workload's startup probe gives up before its cold start ends.
        StartupProbeTooShort,
        /// An evicted workload is not serving again after the node recovered.
        WorkloadNotRecovered,
        /// The GPU report could not be read; it is ignored.
        MalformedGpuReport,
        /// The GPU report was not refreshed in time.
        StaleReport,
        /// The report's writer says it cannot read the GPUs.
        GpusUnreadable,
        /// A rung was passed over: the node's agent cannot carry it out.
        RungUnavailable,
        /// The maintenance notice could not be read; it is ignored.
        MalformedMaintenanceNotice,
        /// A maintenance's deadline passed before gpuhealth drained the node.
        MaintenanceDeadlinePassed,
        /// Drained for a maintenance that has not happened by its deadline.
        MaintenanceOverdue,
        /// An administrator cleared a request or the cordon record by hand.
        BreakGlass,
        /// The Node was deleted while gpuhealth was remediating it.
        NodeDeleted,
        /// The policy asked for per-GPU quarantine and the node was cordoned
        /// instead (`status.quarantine.why` says why).
        NodeQuarantinedInstead,
    }
}

impl FindingKind {
    /// Whether the finding is about a GPU being bad now, so that it is
    /// answered once no GPU of the node is.
    pub fn about_a_bad_gpu(self) -> bool {
        self == FindingKind::PodOnBadGpu
    }
}
