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
        /// The node has no GPU report at all, longer after it was selected
        /// than the policy's `detection.gpuReport.staleAfter`.
        NoReport,
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
        /// An Xid the kernel log alone showed, which NVML's own events did
        /// not confirm: not acted on (a tenant's process can print lines
        /// into the kernel log).
        UncorroboratedXid,
        /// A pod's own code faulted a GPU again and again (application
        /// Xids): the workload's problem; nothing is done to the GPU.
        AppFaultLoop,
        /// The node's record says something is under way, and gpuhealth's
        /// operator did not write it: nothing it records is carried out.
        ForgedRecord,
    }
}

impl FindingKind {
    /// Whether the finding is about a GPU being bad now, so that it is
    /// answered once no GPU of the node is.
    pub fn about_a_bad_gpu(self) -> bool {
        self == FindingKind::PodOnBadGpu
    }
}

/// What a finding is about: `status.findings[].subject`, written as the
/// object's usual name so that a person reads it as is, and read back by
/// its shape.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(from = "String", into = "String")]
pub enum FindingSubject {
    /// One of the node's incidents: `incident/<id>`.
    Incident(String),
    /// A workload: `<Kind>/<namespace>/<name>`.
    Workload(String),
    /// A pod: `<namespace>/<name>`.
    Pod(super::PodKey),
    /// Anything else, as written: who gave a maintenance notice, or a
    /// subject an older release wrote.
    Named(String),
}

const INCIDENT_PREFIX: &str = "incident/";

impl From<String> for FindingSubject {
    fn from(s: String) -> Self {
        if let Some(id) = s.strip_prefix(INCIDENT_PREFIX) {
            return FindingSubject::Incident(id.to_owned());
        }
        let parts: Vec<&str> = s.split('/').collect();
        match parts.as_slice() {
            [kind, namespace, name] if ![kind, namespace, name].iter().any(|p| p.is_empty()) => {
                FindingSubject::Workload(s)
            }
            [namespace, name] if !namespace.is_empty() && !name.is_empty() => {
                FindingSubject::Pod(super::PodKey::new(*namespace, *name))
            }
            _ => FindingSubject::Named(s),
        }
    }
}

impl From<&str> for FindingSubject {
    fn from(s: &str) -> Self {
        FindingSubject::from(s.to_owned())
    }
}

impl From<FindingSubject> for String {
    fn from(s: FindingSubject) -> String {
        s.to_string()
    }
}

impl std::fmt::Display for FindingSubject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FindingSubject::Incident(id) => write!(f, "{INCIDENT_PREFIX}{id}"),
            FindingSubject::Workload(name) | FindingSubject::Named(name) => f.write_str(name),
            FindingSubject::Pod(pod) => write!(f, "{pod}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_subject_reads_back_as_it_was_written() {
        let subjects = [
            FindingSubject::Incident("inc-1780042543-9a371f29eed4".into()),
            FindingSubject::Workload("Deployment/ml-serving/qwen".into()),
            FindingSubject::Pod(crate::vocabulary::PodKey::new("ml-serving", "qwen-0")),
            FindingSubject::Named("aws-scheduled-events".into()),
        ];
        for subject in subjects {
            let written = serde_json::to_value(&subject).expect("written");
            assert!(written.is_string(), "{written}");
            let read: FindingSubject = serde_json::from_value(written.clone()).expect("read");
            assert_eq!(read, subject, "{written}");
        }
        // Whatever is stored is kept, shape or not.
        let odd: FindingSubject = serde_json::from_str(r#""a/b/c/d""#).expect("read");
        assert_eq!(odd.to_string(), "a/b/c/d");
    }
}
