//! Application Xids (13, 31, 32, 68, 69, 94): any kernel that faults
//! raises them, a tenant's buggy code as much as a bad GPU, so whose they
//! are decides what they mean.
//!
//! The agent names, for each Xid, the pod that alone held the GPU when it
//! came (`XidEvent::pod`). Repeats from one pod are that workload's own
//! problem: a finding on the pod, nothing done to the GPU, nothing counted
//! against the node. A GPU is reset for application Xids only when they
//! repeat across at least two workloads (the same code failing in
//! different hands points at the GPU), or beside a sign of the hardware's
//! own (a degraded reading, a row remap); Xids whose pod is unknown count
//! as one workload, never as two.

use std::collections::BTreeMap;

use gpuhealth_api::{
    GpuHealth,
    contract::{GpuEntry, XidEvent},
    vocabulary::PodKey,
};

use crate::xid::APP_FAULT_REPEATS;

/// A pod whose own code faulted one GPU again and again within the window.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AppFaultLoop {
    pub pod: PodKey,
    /// The GPU, in words.
    pub gpu: String,
    /// The codes of its faults, oldest first.
    pub codes: Vec<u32>,
}

/// What one GPU's application Xids within the window call for.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Verdict {
    /// Why the GPU is reset, if it is.
    pub reset: Option<String>,
    pub loops: Vec<AppFaultLoop>,
}

/// Judges `faults`, the application Xids of `gpu` (named `name`) within
/// the window.
pub(super) fn judge(gpu: &GpuEntry, name: &str, faults: &[&XidEvent]) -> Verdict {
    let mut by_workload: BTreeMap<Option<PodKey>, Vec<u32>> = BTreeMap::new();
    for x in faults {
        let pod = x.pod.as_ref().map(|p| PodKey::new(&p.namespace, &p.name));
        by_workload.entry(pod).or_default().push(x.code);
    }
    let loops = by_workload
        .iter()
        .filter(|(_, codes)| codes.len() >= APP_FAULT_REPEATS)
        .filter_map(|(pod, codes)| {
            Some(AppFaultLoop {
                pod: pod.clone()?,
                gpu: name.to_owned(),
                codes: codes.clone(),
            })
        })
        .collect();
    let reset = (faults.len() >= APP_FAULT_REPEATS)
        .then(|| {
            if by_workload.len() >= 2 {
                Some(format!(
                    "{} application Xids within an hour on {name}, from {} workloads: the GPU, not one workload's code",
                    faults.len(),
                    by_workload.len()
                ))
            } else {
                hardware_sign(gpu).map(|sign| {
                    format!(
                        "{} application Xids within an hour on {name}, which also {sign}",
                        faults.len()
                    )
                })
            }
        })
        .flatten();
    Verdict { reset, loops }
}

/// A sign of the GPU's own that it is failing, which alone asks for
/// nothing.
fn hardware_sign(gpu: &GpuEntry) -> Option<String> {
    if gpu.health != GpuHealth::Healthy {
        return Some(format!("reads {:?}", gpu.health));
    }
    let rows = gpu.remapped_rows.as_ref()?;
    (rows.pending || rows.failure).then(|| "has a row remap pending or failed".to_owned())
}

#[cfg(test)]
mod tests {
    use gpuhealth_api::contract::{PodRef, RemappedRows};
    use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};

    use super::*;

    fn gpu() -> GpuEntry {
        GpuEntry {
            index: 7,
            uuid: "GPU-0a1b2c3d-0000-4000-8000-000000000007".into(),
            pci_bus_id: "00000000:E1:00.0".into(),
            product: None,
            health: GpuHealth::Healthy,
            xids: Vec::new(),
            recovery_action: None,
            remapped_rows: None,
            pods: Vec::new(),
            pods_unknown: None,
            offered: None,
        }
    }

    fn fault(code: u32, pod: Option<&str>) -> XidEvent {
        XidEvent {
            pod: pod.map(|name| PodRef {
                namespace: "tenant".into(),
                name: name.into(),
                container: None,
            }),
            ..XidEvent::new(code, Time(Timestamp::UNIX_EPOCH), "")
        }
    }

    fn judged(gpu: &GpuEntry, faults: &[XidEvent]) -> Verdict {
        let refs: Vec<&XidEvent> = faults.iter().collect();
        judge(gpu, "GPU 7", &refs)
    }

    #[test]
    fn one_pods_repeats_are_its_own_not_the_gpus() {
        let v = judged(
            &gpu(),
            &[
                fault(13, Some("a")),
                fault(31, Some("a")),
                fault(13, Some("a")),
            ],
        );
        assert_eq!(v.reset, None);
        assert_eq!(
            v.loops,
            [AppFaultLoop {
                pod: PodKey::new("tenant", "a"),
                gpu: "GPU 7".into(),
                codes: vec![13, 31, 13],
            }]
        );
        // Twice is not yet a loop.
        assert_eq!(
            judged(&gpu(), &[fault(13, Some("a")), fault(13, Some("a"))]),
            Verdict::default()
        );
    }

    #[test]
    fn faults_across_two_workloads_reset_the_gpu() {
        let v = judged(
            &gpu(),
            &[
                fault(13, Some("a")),
                fault(13, Some("a")),
                fault(13, Some("b")),
            ],
        );
        assert!(
            v.reset
                .as_deref()
                .is_some_and(|m| m.contains("from 2 workloads")),
            "{v:?}"
        );
        assert!(v.loops.is_empty(), "{v:?}");
        // Faults of no known pod are one workload, never two.
        let nobody = [
            fault(13, None),
            fault(13, None),
            fault(31, None),
            fault(13, None),
        ];
        assert_eq!(judged(&gpu(), &nobody).reset, None);
        let v = judged(
            &gpu(),
            &[fault(13, None), fault(13, None), fault(13, Some("a"))],
        );
        assert!(v.reset.is_some(), "a pod's and nobody's are two");
    }

    #[test]
    fn a_sign_of_the_hardwares_own_resets_it_for_one_workloads_faults() {
        let faults = [
            fault(13, Some("a")),
            fault(13, Some("a")),
            fault(13, Some("a")),
        ];
        let mut degraded = gpu();
        degraded.health = GpuHealth::Degraded;
        assert!(judged(&degraded, &faults).reset.is_some());
        let mut remapping = gpu();
        remapping.remapped_rows = Some(RemappedRows {
            pending: true,
            failure: false,
        });
        let v = judged(&remapping, &faults);
        assert!(
            v.reset.as_deref().is_some_and(|m| m.contains("row remap")),
            "{v:?}"
        );
        assert_eq!(v.loops.len(), 1, "and the pod is told");
    }
}
