//! GPU reports for simulated nodes, shaped like the incident's.

use gpuhealth_api::{
    GpuHealth,
    contract::{AnnotationValue, GpuReport, PodRef, XidEvent},
};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};

const INCIDENT: &str =
    include_str!("../../crates/gpuhealth-api/tests/fixtures/incident-gpu-report.json");

/// Eight healthy RTX 5090 D GPUs; GPU `i` held by `pods[i]` where given.
pub fn healthy(namespace: &str, pods: &[String]) -> GpuReport {
    let mut report = match GpuReport::parse(INCIDENT) {
        Ok(r) => r,
        Err(e) => unreachable!("the bundled fixture is valid: {e}"),
    };
    report.source = Some("gpuhealth-e2e/fake-agent".into());
    for (i, gpu) in report.gpus.iter_mut().enumerate() {
        gpu.health = GpuHealth::Healthy;
        gpu.xids.clear();
        gpu.recovery_action = Some(0);
        gpu.remapped_rows = None;
        gpu.pods = pods
            .get(i)
            .map(|p| PodRef {
                namespace: namespace.into(),
                name: p.clone(),
                container: Some("server".into()),
            })
            .into_iter()
            .collect();
    }
    report
}

/// The incident on GPU `index`: Xid 119 (GSP timeout), then Xid 154 asking
/// for a reset, and the recovery action NVML reports with it.
pub fn xid_119_and_154(report: &mut GpuReport, index: usize) {
    let now = Time(Timestamp::now());
    if let Some(gpu) = report.gpus.get_mut(index) {
        gpu.health = GpuHealth::ResetRequired;
        gpu.recovery_action = Some(1);
        gpu.xids = vec![
            XidEvent::new(
                119,
                now.clone(),
                "Timeout after 45s of waiting for RPC response from GPU GSP",
            ),
            XidEvent::new(
                154,
                now,
                "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
            ),
        ];
    }
}

/// An application Xid (13) on GPU `index`, now, blamed on pod
/// `namespace/pod`: as the agent names the pod that alone held the GPU.
pub fn app_fault(report: &mut GpuReport, index: usize, namespace: &str, pod: &str) {
    if let Some(gpu) = report.gpus.get_mut(index) {
        gpu.xids.push(XidEvent {
            pid: Some(4242),
            process: Some("python3".into()),
            pod: Some(PodRef {
                namespace: namespace.into(),
                name: pod.into(),
                container: Some("server".into()),
            }),
            ..XidEvent::new(13, Time(Timestamp::now()), "Graphics Exception")
        });
    }
}
