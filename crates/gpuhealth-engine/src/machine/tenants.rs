//! What a tenant's own doing shows on a node: a pod's code faulting its
//! GPU again and again, and Xids the kernel log alone told, which a
//! tenant's process may have printed. Each is a finding (an Event, and
//! `gpuhealth_findings_total`), never an action and never a count toward
//! the node's remediation limits.

use gpuhealth_api::vocabulary::{FindingKind, FindingSubject};

use crate::machine::core::Stepper;

impl Stepper<'_> {
    pub(super) fn tenant_findings(&mut self) {
        for found in self.diagnosis.app_fault_loops.clone() {
            let codes: Vec<String> = found.codes.iter().map(u32::to_string).collect();
            self.finding_about(
                FindingKind::AppFaultLoop,
                Some(FindingSubject::Pod(found.pod.clone())),
                format!(
                    "pod {} faulted {} {} times within an hour (application Xids {}): its own code's faults, not the GPU's; the GPU stays in service and nothing is counted against the node",
                    found.pod,
                    found.gpu,
                    found.codes.len(),
                    codes.join(", ")
                ),
                Some(found.pod),
            );
        }
        for (gpu, xid) in self.diagnosis.uncorroborated.clone() {
            let process = match (&xid.process, xid.pid) {
                (Some(name), Some(pid)) => format!(", naming process {name:?} (pid {pid})"),
                _ => String::new(),
            };
            self.finding(
                FindingKind::UncorroboratedXid,
                Some(FindingSubject::Named(gpu.clone())),
                format!(
                    "the kernel log shows Xid {} on {gpu} at {}{process}, which NVML's own Xid events did not report: not acted on (a process on the node can print such a line); if the GPU misbehaves, look at nvidia-smi and the driver's log on the node",
                    xid.code, xid.at.0
                ),
            );
        }
    }
}
