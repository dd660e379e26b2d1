//! Signals from a GPU's device as others see it: the taints its DRA driver
//! puts on it, and the kubelet's health of it in the status of the pod
//! that holds it.

use gpuhealth_api::{
    contract::GpuReport,
    policy::Detection,
    vocabulary::{DeviceId, Reason},
};
use k8s_openapi::jiff::Timestamp;

use super::{Diagnosis, Evidence, Signal};

/// A device the kubelet reports `Unhealthy` in the status of a pod that
/// holds it (`allocatedResourcesStatus`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnhealthyDevice {
    /// The pod, as `namespace/name`.
    pub pod: String,
    pub device: HeldDevice,
    /// Why, in the words of the device's plugin or driver, if it gave any.
    pub message: Option<String>,
    /// When it was first seen unhealthy: when a watch saw it turn, or, for
    /// one already unhealthy when the watch started, when the pod started
    /// (the earliest it can have turned).
    pub since: Timestamp,
}

/// Which device the kubelet means.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HeldDevice {
    /// A device plugin's device, by the plugin's id for it (NVIDIA's: the
    /// GPU's UUID, or its index with `DEVICE_ID_STRATEGY=index`).
    Plugin(String),
    /// A DRA device and the UUID it publishes.
    Dra { id: DeviceId, uuid: Option<String> },
    /// A DRA device of a claim holding several GPUs, named by an id that
    /// does not say which (a CDI device id).
    Unplaced(String),
}

/// How the kubelet names it.
impl std::fmt::Display for HeldDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HeldDevice::Plugin(id) | HeldDevice::Unplaced(id) => f.write_str(id),
            HeldDevice::Dra { id, .. } => write!(f, "{id}"),
        }
    }
}

impl HeldDevice {
    /// The UUID of the GPU it is, if that can be told.
    fn gpu(&self, report: Option<&GpuReport>) -> Option<String> {
        match self {
            HeldDevice::Plugin(id) => report?
                .gpus
                .iter()
                .find(|g| g.uuid == *id || g.index.to_string() == *id)
                .map(|g| g.uuid.clone()),
            HeldDevice::Dra { uuid, .. } => uuid.clone(),
            HeldDevice::Unplaced(_) => None,
        }
    }
}

/// A taint of `detection.deviceTaints` on a GPU's device, added since the
/// GPU's last remediation, is that GPU's signal.
pub(super) fn device_taint_signals(
    detection: &Detection,
    evidence: &Evidence<'_>,
    d: &mut Diagnosis,
) {
    for device in evidence.devices {
        let Some(uuid) = &device.uuid else {
            continue;
        };
        for taint in &device.taints {
            let Some(rule) = detection.device_taints.iter().find(|r| r.key == taint.key) else {
                continue;
            };
            let Some(action) = rule.action.recovery_action() else {
                continue;
            };
            let added = taint.time_added;
            if evidence
                .xids_since
                .is_some_and(|since| added.is_none_or(|a| a <= since))
            {
                continue;
            }
            let value = taint
                .value
                .as_deref()
                .map_or_else(String::new, |v| format!("={v}"));
            let at = added.map_or_else(String::new, |a| format!(" at {a}"));
            d.signals.push(Signal {
                action,
                reason: Reason::DeviceTainted,
                message: format!(
                    "its DRA driver tainted device {} (GPU {uuid}) {}{value}:{}{at}",
                    device.id(),
                    taint.key,
                    taint.effect
                ),
                gpu: Some(uuid.clone()),
                xid: None,
            });
        }
    }
}

/// A GPU the kubelet reports `Unhealthy` in a pod's status since the
/// GPU's last remediation is that GPU's signal. One it cannot be told
/// which GPU it is (an id matching none) is the node's.
pub(super) fn pod_device_health_signals(
    detection: &Detection,
    evidence: &Evidence<'_>,
    d: &mut Diagnosis,
) {
    let Some(action) = detection.pod_device_health.action.recovery_action() else {
        return;
    };
    let report = evidence.report.and_then(|r| r.as_ref().ok());
    for u in evidence.unhealthy {
        if evidence.xids_since.is_some_and(|since| u.since <= since) {
            continue;
        }
        let gpu = u.device.gpu(report);
        let which = gpu.as_deref().map_or_else(
            || "a GPU it cannot place".to_owned(),
            |g| format!("GPU {g}"),
        );
        let why = u
            .message
            .as_deref()
            .map_or_else(String::new, |m| format!(": {m}"));
        d.signals.push(Signal {
            action,
            reason: Reason::DeviceUnhealthy,
            message: format!(
                "the kubelet reports device {} ({which}) of pod {} Unhealthy since {}{why}",
                u.device, u.pod, u.since
            ),
            gpu,
            xid: None,
        });
    }
}

#[cfg(test)]
mod tests {
    use gpuhealth_api::{GpuHealth, RecoveryAction, contract::ContractError, types::SignalAction};

    use super::{
        super::{
            diagnose,
            tests::{detection, incident_report, ts},
        },
        *,
    };
    use crate::fence::{DeviceTaintView, DeviceView};

    /// The incident's report with every GPU well: what a device says is
    /// then the only signal.
    fn every_gpu_well() -> GpuReport {
        let mut report = incident_report().expect("valid");
        for g in &mut report.gpus {
            g.health = GpuHealth::Healthy;
            g.recovery_action = Some(0);
            g.xids.clear();
        }
        report
    }

    #[test]
    fn a_drivers_device_taint_is_its_gpus_signal_until_a_remediation_answers_it() {
        let report = Ok(every_gpu_well());
        let tainted = |key: &str| DeviceView {
            driver: "gpu.nvidia.com".into(),
            pool: "node-a".into(),
            name: "gpu-3".into(),
            uuid: Some("GPU-0a1b2c3d-0000-4000-8000-000000000003".into()),
            taints: vec![DeviceTaintView {
                key: key.into(),
                value: Some("79".into()),
                effect: "NoSchedule".into(),
                time_added: Some(ts("2026-05-29T08:20:00Z")),
            }],
        };
        let devices = [tainted("gpu.nvidia.com/xid")];
        let evidence = |since: Option<Timestamp>, devices| Evidence {
            conditions: &[],
            report: Some(&report),
            report_refreshed_at: None,
            report_awaited_since: None,
            report_missing_before: false,
            xids_since: since,
            devices,
            unhealthy: &[],
            gang_window: None,
        };
        let now = ts("2026-05-29T08:25:00Z");
        let d = diagnose(now, &detection(), &evidence(None, &devices));
        assert_eq!(d.required(), Some(RecoveryAction::GpuReset));
        assert_eq!(d.gpus(), ["GPU-0a1b2c3d-0000-4000-8000-000000000003"]);
        assert_eq!(d.signals[0].reason, Reason::DeviceTainted);
        assert!(
            d.signals[0]
                .message
                .contains("device gpu.nvidia.com/node-a/gpu-3 (GPU GPU-0a1b2c3d-0000-4000-8000-000000000003) gpu.nvidia.com/xid=79:NoSchedule"),
            "{}",
            d.signals[0].message
        );
        let lost = [tainted("gpu.nvidia.com/gpu-lost")];
        let d = diagnose(now, &detection(), &evidence(None, &lost));
        assert_eq!(d.required(), Some(RecoveryAction::NodeReboot));
        // Added before the last remediation: answered, though the driver
        // never lifts it.
        let d = diagnose(
            now,
            &detection(),
            &evidence(Some(ts("2026-05-29T08:21:00Z")), &devices),
        );
        assert!(d.is_clear(), "{d:?}");
        // A key the policy does not list is not a signal.
        let other = [tainted("example.com/maintenance")];
        assert!(diagnose(now, &detection(), &evidence(None, &other)).is_clear());
    }

    fn unhealthy(device: HeldDevice, since: &str) -> UnhealthyDevice {
        UnhealthyDevice {
            pod: "serving/llama-0".into(),
            device,
            message: Some("Xid 79".into()),
            since: ts(since),
        }
    }

    #[test]
    fn a_gpu_the_kubelet_calls_unhealthy_is_its_signal_until_a_remediation_answers_it() {
        let report = Ok(every_gpu_well());
        let gpu3 = "GPU-0a1b2c3d-0000-4000-8000-000000000003";
        fn with<'a>(
            report: &'a Result<GpuReport, ContractError>,
            since: Option<Timestamp>,
            unhealthy: &'a [UnhealthyDevice],
        ) -> Evidence<'a> {
            Evidence {
                conditions: &[],
                report: Some(report),
                report_refreshed_at: None,
                report_awaited_since: None,
                report_missing_before: false,
                xids_since: since,
                devices: &[],
                unhealthy,
                gang_window: None,
            }
        }
        let now = ts("2026-05-29T08:25:00Z");
        // A device plugin's id, as a UUID or as an index; a DRA device.
        for device in [
            HeldDevice::Plugin(gpu3.into()),
            HeldDevice::Plugin("3".into()),
            HeldDevice::Dra {
                id: DeviceId::new("gpu.nvidia.com", "node-a", "gpu-3"),
                uuid: Some(gpu3.into()),
            },
        ] {
            let held = [unhealthy(device.clone(), "2026-05-29T08:20:00Z")];
            let d = diagnose(now, &detection(), &with(&report, None, &held));
            assert_eq!(d.required(), Some(RecoveryAction::GpuReset), "{device:?}");
            assert_eq!(d.gpus(), [gpu3], "{device:?}");
            assert_eq!(d.signals[0].reason, Reason::DeviceUnhealthy);
            assert!(
                d.signals[0]
                    .message
                    .contains("of pod serving/llama-0 Unhealthy")
                    && d.signals[0].message.ends_with(": Xid 79"),
                "{}",
                d.signals[0].message
            );
            // Seen before the last remediation: answered, though the
            // kubelet still says so for a pod that was never drained.
            let d = diagnose(
                now,
                &detection(),
                &with(&report, Some(ts("2026-05-29T08:21:00Z")), &held),
            );
            assert!(d.is_clear(), "{d:?}");
        }
        // An id that names no GPU of the report is a signal of the node.
        for device in [
            HeldDevice::Plugin("GPU-ffffffff".into()),
            HeldDevice::Unplaced("k8s.gpu.nvidia.com/device=claim-1".into()),
        ] {
            let held = [unhealthy(device.clone(), "2026-05-29T08:20:00Z")];
            let d = diagnose(now, &detection(), &with(&report, None, &held));
            assert_eq!(d.required(), Some(RecoveryAction::GpuReset), "{device:?}");
            assert_eq!(d.signals[0].gpu, None, "{device:?}");
            assert!(d.signals[0].message.contains("a GPU it cannot place"));
        }
        // A policy may ignore it.
        let mut ignoring = detection();
        ignoring.pod_device_health.action = SignalAction::Ignore;
        let held = [unhealthy(
            HeldDevice::Plugin(gpu3.into()),
            "2026-05-29T08:20:00Z",
        )];
        assert!(diagnose(now, &ignoring, &with(&report, None, &held)).is_clear());
    }
}
