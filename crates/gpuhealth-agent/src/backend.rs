//! Where GPU health comes from and how requests are carried out: NVML on a
//! real node, the `gpuhealth.io/sim-hardware` annotation on a simulated one.

use std::{future::Future, path::PathBuf, process::Command};

use gpuhealth_api::{
    GpuHealth,
    contract::{GpuEntry, Outcome},
};
use k8s_openapi::{api::core::v1::Node, jiff::Timestamp};
use kube::{
    Api, Client, ResourceExt,
    api::{Patch, PatchParams},
};
use serde::{Deserialize, Serialize};
use serde_json::json;

use prometheus_client::metrics::{counter::Counter, family::Family};

use crate::{
    kmsg::{Feed, PciAddress},
    metrics::CodeLabels,
    nvml::{self, DeviceReading, DeviceSource, NvmlSource},
    pod_resources,
};

/// What a backend did with a request, and why.
pub type Done = (Outcome, String);

pub trait Backend: Send {
    /// The report's `source`.
    fn source(&self) -> &'static str;
    /// Every GPU now; `node` is the agent's Node as last seen.
    fn read(&mut self, node: &Node) -> impl Future<Output = Result<Vec<GpuEntry>, String>> + Send;
    /// Resets `gpus` (UUIDs) for request `id`.
    fn reset(
        &mut self,
        node: &Node,
        id: &str,
        gpus: &[String],
    ) -> impl Future<Output = Done> + Send;
    fn reboot(&mut self, node: &Node, id: &str) -> impl Future<Output = Done> + Send;
}

/// The simulated hardware of a KWOK node, written by a test or `gpuhealth-sim`.
pub const SIM_HARDWARE_ANNOTATION: &str = "gpuhealth.io/sim-hardware";

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum SimOutcome {
    #[default]
    Succeed,
    Fail,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SimHardware {
    pub gpus: Vec<GpuEntry>,
    /// How resets and reboots end on this node.
    #[serde(default)]
    pub reset: SimOutcome,
    #[serde(default)]
    pub reboot: SimOutcome,
    /// Every request id the simulated hardware carried out, in order: what
    /// a test counts to prove none ran twice.
    #[serde(default)]
    pub executed: Vec<String>,
}

/// The fake backend: the hardware is the node's `gpuhealth.io/sim-hardware`
/// annotation; a reset or reboot that succeeds heals it.
pub struct FakeBackend {
    pub client: Client,
    /// Xids by code, counted as the simulated hardware first shows each
    /// (the kernel log does this for the NVML backend).
    pub xids: Family<CodeLabels, Counter>,
    /// The Xids counted so far, as (GPU, code, time).
    pub seen: std::collections::BTreeSet<(String, u32, i64)>,
}

impl FakeBackend {
    fn hardware(node: &Node) -> Result<SimHardware, String> {
        let raw = node
            .annotations()
            .get(SIM_HARDWARE_ANNOTATION)
            .ok_or_else(|| format!("no {SIM_HARDWARE_ANNOTATION} annotation on the node"))?;
        serde_json::from_str(raw).map_err(|e| format!("{SIM_HARDWARE_ANNOTATION}: {e}"))
    }

    async fn save(&self, node: &Node, hw: &SimHardware) -> Result<(), String> {
        let value = serde_json::to_string(hw).map_err(|e| e.to_string())?;
        let patch = json!({"metadata": {"annotations": {SIM_HARDWARE_ANNOTATION: value}}});
        Api::<Node>::all(self.client.clone())
            .patch(
                &node.name_any(),
                &PatchParams::default(),
                &Patch::Merge(patch),
            )
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    /// Records the request, heals `which` GPUs if the hardware says it works.
    async fn carry_out(
        &self,
        node: &Node,
        id: &str,
        outcome: impl Fn(&SimHardware) -> SimOutcome,
        which: impl Fn(&GpuEntry) -> bool,
    ) -> Result<bool, String> {
        let mut hw = Self::hardware(node)?;
        hw.executed.push(id.to_owned());
        let works = outcome(&hw) == SimOutcome::Succeed;
        if works {
            for gpu in hw.gpus.iter_mut().filter(|g| which(g)) {
                gpu.health = GpuHealth::Healthy;
                gpu.recovery_action = Some(0);
                gpu.xids.clear();
                gpu.remapped_rows = None;
            }
        }
        self.save(node, &hw).await?;
        Ok(works)
    }
}

impl Backend for FakeBackend {
    fn source(&self) -> &'static str {
        "gpuhealth-agent/fake"
    }

    async fn read(&mut self, node: &Node) -> Result<Vec<GpuEntry>, String> {
        let gpus = Self::hardware(node)?.gpus;
        for g in &gpus {
            for x in &g.xids {
                if self
                    .seen
                    .insert((g.uuid.clone(), x.code, x.at.0.as_second()))
                {
                    self.xids
                        .get_or_create(&CodeLabels {
                            code: x.code.to_string(),
                        })
                        .inc();
                }
            }
        }
        Ok(gpus)
    }

    async fn reset(&mut self, node: &Node, id: &str, gpus: &[String]) -> Done {
        match self
            .carry_out(node, id, |hw| hw.reset, |g| gpus.contains(&g.uuid))
            .await
        {
            Ok(true) => (Outcome::Succeeded, format!("reset {}", gpus.join(", "))),
            Ok(false) => (Outcome::Failed, "the GPU reset failed (simulated)".into()),
            Err(e) => (Outcome::Failed, e),
        }
    }

    async fn reboot(&mut self, node: &Node, id: &str) -> Done {
        match self.carry_out(node, id, |hw| hw.reboot, |_| true).await {
            Ok(true) => {
                // A new boot: what the operator checks a reboot by.
                let boot = format!("boot-{}", Timestamp::now().as_millisecond());
                let status = json!({"status": {"nodeInfo": {"bootID": boot}}});
                match Api::<Node>::all(self.client.clone())
                    .patch_status(
                        &node.name_any(),
                        &PatchParams::default(),
                        &Patch::Merge(status),
                    )
                    .await
                {
                    Ok(_) => (Outcome::Succeeded, "rebooted (simulated)".into()),
                    Err(e) => (Outcome::Failed, format!("changing the bootID: {e}")),
                }
            }
            Ok(false) => (Outcome::Failed, "the reboot failed (simulated)".into()),
            Err(e) => (Outcome::Failed, e),
        }
    }
}

/// How the NVML backend reboots its node.
#[derive(Clone, Debug)]
pub enum RebootMethod {
    /// Refuse: a person or another tool reboots.
    None,
    /// Create kured's sentinel file; kured reboots under its own lock.
    Kured(PathBuf),
    /// `systemctl reboot` in the host's namespaces (needs `hostPID`).
    Systemd,
}

/// The NVML backend: reads through NVML, names each GPU's pods from the
/// kubelet's PodResources socket, resets with `nvidia-smi`.
pub struct NvmlBackend<S = NvmlSource> {
    pub source: S,
    /// The Xids, from the kernel log (NVML's XID events miss what happened
    /// before the agent started).
    pub kernel_log: Option<Feed>,
    pub pod_resources: PathBuf,
    pub reboot_method: RebootMethod,
    /// `nvidia-smi`, found on `PATH` unless given.
    pub nvidia_smi: PathBuf,
}

/// Fills each GPU's Xids from the kernel log, matched by PCI address.
fn add_xids(gpus: &mut [GpuEntry], kernel_log: Option<&Feed>) {
    let Some(feed) = kernel_log else { return };
    feed.with(|log| {
        for gpu in gpus.iter_mut() {
            if let Some(pci) = PciAddress::parse(&gpu.pci_bus_id) {
                gpu.xids = log.xids(&pci).to_vec();
            }
        }
    });
}

/// After a successful reset, the Xids logged before it are answered.
fn forget_xids(readings: &[DeviceReading], reset: &[String], kernel_log: Option<&Feed>) {
    let Some(feed) = kernel_log else { return };
    feed.with(|log| {
        for r in readings.iter().filter(|r| reset.contains(&r.uuid)) {
            if let Some(pci) = PciAddress::parse(&r.pci_bus_id) {
                log.forget(&pci);
            }
        }
    });
}

/// The backend for a node where NVML cannot be loaded: the GPUs as the
/// kernel log describes them. It cannot reset (nvidia-smi needs NVML).
pub struct KmsgBackend {
    pub kernel_log: Feed,
    pub reboot_method: RebootMethod,
}

impl Backend for KmsgBackend {
    fn source(&self) -> &'static str {
        "gpuhealth-agent/kmsg"
    }

    async fn read(&mut self, _node: &Node) -> Result<Vec<GpuEntry>, String> {
        Ok(self.kernel_log.with(|log| log.entries()))
    }

    async fn reset(&mut self, _node: &Node, _id: &str, _gpus: &[String]) -> Done {
        (
            Outcome::Refused,
            "NVML is not available on this node, so the agent cannot reset a GPU".into(),
        )
    }

    async fn reboot(&mut self, _node: &Node, _id: &str) -> Done {
        self.reboot_method.reboot()
    }
}

impl<S: DeviceSource> Backend for NvmlBackend<S> {
    fn source(&self) -> &'static str {
        "gpuhealth-agent/nvml"
    }

    async fn read(&mut self, _node: &Node) -> Result<Vec<GpuEntry>, String> {
        let mut gpus: Vec<GpuEntry> = self
            .source
            .read()
            .map(|readings| readings.iter().map(nvml::entry).collect())
            .map_err(|e| e.to_string())?;
        // Without the kubelet's answer the report names no pods; the
        // operator then treats every GPU pod on the node as possibly affected.
        add_xids(&mut gpus, self.kernel_log.as_ref());
        match pod_resources::list(&self.pod_resources).await {
            Ok(mut holders) => {
                for gpu in &mut gpus {
                    gpu.pods = holders.remove(&gpu.uuid).unwrap_or_default();
                }
            }
            Err(e) => tracing::warn!(error = %e, "which pod holds which GPU is unknown"),
        }
        Ok(gpus)
    }

    async fn reset(&mut self, _node: &Node, _id: &str, gpus: &[String]) -> Done {
        let readings = match self.source.read() {
            Ok(r) => r,
            Err(e) => return (Outcome::Failed, e.to_string()),
        };
        // A reset with a process on the GPU fails or kills it: refuse instead.
        let busy: Vec<String> = readings
            .iter()
            .filter(|r| gpus.contains(&r.uuid) && !r.compute_processes.is_empty())
            .map(|r| format!("{} (pids {:?})", r.uuid, r.compute_processes))
            .collect();
        if !busy.is_empty() {
            return (
                Outcome::Refused,
                format!("processes still use {}", busy.join(", ")),
            );
        }
        for uuid in gpus {
            let out = Command::new(&self.nvidia_smi)
                .args(["--gpu-reset", "-i", uuid])
                .output();
            match out {
                Ok(o) if o.status.success() => {}
                Ok(o) => {
                    let why = String::from_utf8_lossy(&o.stdout).trim().to_owned()
                        + String::from_utf8_lossy(&o.stderr).trim();
                    return (
                        Outcome::Failed,
                        format!("nvidia-smi --gpu-reset -i {uuid}: {why}"),
                    );
                }
                Err(e) => {
                    return (
                        Outcome::Failed,
                        format!("running {}: {e}", self.nvidia_smi.display()),
                    );
                }
            }
        }
        forget_xids(&readings, gpus, self.kernel_log.as_ref());
        (Outcome::Succeeded, format!("reset {}", gpus.join(", ")))
    }

    async fn reboot(&mut self, _node: &Node, _id: &str) -> Done {
        self.reboot_method.reboot()
    }
}

impl RebootMethod {
    fn reboot(&self) -> Done {
        match self {
            RebootMethod::None => (
                Outcome::Refused,
                "this agent does not reboot (--reboot-method none)".into(),
            ),
            RebootMethod::Kured(path) => match std::fs::File::create(path) {
                Ok(_) => (
                    Outcome::Succeeded,
                    format!("created kured's sentinel {}", path.display()),
                ),
                Err(e) => (Outcome::Failed, format!("creating {}: {e}", path.display())),
            },
            RebootMethod::Systemd => {
                let out = Command::new("nsenter")
                    .args([
                        "--target", "1", "--mount", "--uts", "--ipc", "--net", "--pid",
                    ])
                    .args(["--", "systemctl", "reboot"])
                    .output();
                match out {
                    Ok(o) if o.status.success() => (Outcome::Succeeded, "systemctl reboot".into()),
                    Ok(o) => (
                        Outcome::Failed,
                        format!(
                            "systemctl reboot: {}",
                            String::from_utf8_lossy(&o.stderr).trim()
                        ),
                    ),
                    Err(e) => (Outcome::Failed, format!("running nsenter: {e}")),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{metrics::CodeLabels, nvml::Recorded};
    use prometheus_client::metrics::{counter::Counter, family::Family};

    /// The H200 recorded in docs/device/h200-nvml/, with `change` applied.
    fn h200(change: impl FnOnce(&mut DeviceReading)) -> Recorded {
        let mut readings: Vec<DeviceReading> =
            serde_json::from_str(include_str!("../../../docs/device/h200-nvml/readings.json"))
                .expect("fixture");
        change(&mut readings[0]);
        Recorded(readings)
    }

    fn backend(source: Recorded, feed: Option<Feed>) -> NvmlBackend<Recorded> {
        NvmlBackend {
            source,
            kernel_log: feed,
            pod_resources: PathBuf::from("/nonexistent/kubelet.sock"),
            reboot_method: RebootMethod::None,
            nvidia_smi: PathBuf::from("/nonexistent/nvidia-smi"),
        }
    }

    #[tokio::test]
    async fn a_read_joins_the_device_state_with_the_kernel_logs_xids() {
        let feed = Feed::new(Family::<CodeLabels, Counter>::default());
        feed.nvml_xid("00000000:00:06.0", 119);
        let mut b = backend(h200(|r| r.recovery_action = Some(1)), Some(feed.clone()));
        let gpus = b.read(&Node::default()).await.expect("read");
        assert_eq!(gpus.len(), 1);
        assert_eq!(gpus[0].health, GpuHealth::ResetRequired);
        assert_eq!(
            gpus[0].xids.iter().map(|x| x.code).collect::<Vec<_>>(),
            [119]
        );
        // No kubelet socket here: no pods named, and no failure.
        assert!(gpus[0].pods.is_empty());
    }

    #[tokio::test]
    async fn a_reset_is_refused_while_a_process_holds_the_gpu() {
        let uuid = h200(|_| {}).0[0].uuid.clone();
        let mut b = backend(h200(|r| r.compute_processes = vec![4242]), None);
        let (outcome, why) = b
            .reset(
                &Node::default(),
                "inc-1-reset-1",
                std::slice::from_ref(&uuid),
            )
            .await;
        assert_eq!(outcome, Outcome::Refused);
        assert!(why.contains("4242"), "{why}");

        // Free, it runs nvidia-smi; here there is none to run, and it says so.
        let mut b = backend(h200(|_| {}), None);
        let (outcome, why) = b.reset(&Node::default(), "inc-1-reset-2", &[uuid]).await;
        assert_eq!(outcome, Outcome::Failed);
        assert!(why.contains("/nonexistent/nvidia-smi"), "{why}");
    }

    #[tokio::test]
    async fn reboots_go_the_configured_way() {
        let mut b = backend(h200(|_| {}), None);
        let (outcome, why) = b.reboot(&Node::default(), "inc-1-reboot-1").await;
        assert_eq!(outcome, Outcome::Refused);
        assert!(why.contains("--reboot-method none"), "{why}");
        let sentinel =
            std::env::temp_dir().join(format!("gpuhealth-reboot-required-{}", std::process::id()));
        b.reboot_method = RebootMethod::Kured(sentinel.clone());
        let (outcome, _) = b.reboot(&Node::default(), "inc-1-reboot-2").await;
        assert_eq!(outcome, Outcome::Succeeded);
        assert!(sentinel.exists(), "kured's sentinel was created");
    }
}
