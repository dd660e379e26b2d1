//! The backend of a real GPU node: NVML (on its own thread) for the GPUs'
//! state, the kernel log for their Xids, the kubelet's PodResources for who
//! holds each, `nvidia-smi` for resets, and the configured way to reboot.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use gpuhealth_api::contract::{Capabilities, GpuEntry, Outcome};
use k8s_openapi::{
    api::{core::v1::Node, resource::v1::ResourceSlice},
    jiff::Timestamp,
};
use kube::{Api, Client, ResourceExt, api::ListParams};

use crate::{
    backend::{Backend, Done},
    capability_checks::CapabilityChecks,
    kmsg::{Feed, PciAddress},
    nvml::{self, DeviceReading},
    nvml_thread::{Gpus, NvmlThread},
    pod_resources::{self, DraDevice, Placement},
    reboot::RebootMethod,
    recoveries::Recoveries,
    reset::{self, ResetSettings},
};

/// The NVML backend.
pub struct NvmlBackend<G = NvmlThread> {
    pub gpus: G,
    pub client: Client,
    /// The Xids, from the kernel log and NVML's events (NVML's miss what
    /// happened before the agent started).
    pub kernel_log: Option<Feed>,
    /// The kubelet's PodResources socket.
    pub pod_resources: PathBuf,
    /// How long the kubelet, and the API server for ResourceSlices, get to answer.
    pub deadline: Duration,
    pub reset: ResetSettings,
    pub reboot: RebootMethod,
    pub recoveries: Recoveries,
    checks: CapabilityChecks,
    /// Whether NVML answered the last read.
    nvml_answers: bool,
    /// DRA devices of this node → their UUID, if any, from its
    /// ResourceSlices; read again only when a pod holds a device not in it.
    dra: BTreeMap<DraDevice, Option<String>>,
}

impl<G: Gpus> NvmlBackend<G> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpus: G,
        client: Client,
        kernel_log: Option<Feed>,
        pod_resources: PathBuf,
        deadline: Duration,
        reset: ResetSettings,
        reboot: RebootMethod,
        recoveries: Recoveries,
    ) -> Self {
        NvmlBackend {
            gpus,
            client,
            kernel_log,
            pod_resources,
            deadline,
            reset,
            reboot,
            recoveries,
            checks: CapabilityChecks::default(),
            nvml_answers: false,
            dra: BTreeMap::new(),
        }
    }

    /// Each GPU's Xids from the kernel log and NVML's events, matched by PCI
    /// address, less those its last recovery answered.
    fn add_xids(&self, gpus: &mut [GpuEntry]) {
        let Some(feed) = &self.kernel_log else { return };
        feed.with(|log| {
            for gpu in gpus.iter_mut() {
                if let Some(pci) = PciAddress::parse(&gpu.pci_bus_id) {
                    gpu.xids = self.recoveries.fresh(&gpu.uuid, log.xids(&pci));
                }
            }
        });
    }

    /// Names the pods holding each GPU, or says why they cannot be named.
    async fn add_pods(&mut self, node: &Node, readings: &[DeviceReading], gpus: &mut [GpuEntry]) {
        let response = match pod_resources::list(&self.pod_resources, self.deadline).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "which pod holds which GPU is unknown");
                for gpu in gpus.iter_mut() {
                    gpu.pods_unknown = Some(format!("the kubelet's PodResources: {e}"));
                }
                return;
            }
        };
        let mut placement = Placement::new(readings, self.dra.clone());
        if pod_resources::unplaced_dra(&response, &placement) {
            match self.resource_slices(node).await {
                Ok(dra) => {
                    self.dra = dra;
                    placement = Placement::new(readings, self.dra.clone());
                }
                Err(e) => tracing::warn!(error = %e, "reading this node's ResourceSlices"),
            }
        }
        let mut holders = pod_resources::gpu_holders(&response, &placement);
        let unknown = holders.unknown();
        // Not known rather than wrong: a kubelet that does not answer
        // leaves `offered` unset, and the operator then cordons.
        let offered = match pod_resources::allocatable(&self.pod_resources, self.deadline).await {
            Ok(a) => pod_resources::offered_gpus(&a, &placement),
            Err(e) => {
                tracing::warn!(error = %e, "which GPUs the kubelet offers is unknown");
                None
            }
        };
        for gpu in gpus.iter_mut() {
            gpu.pods = holders.by_gpu.remove(&gpu.uuid).unwrap_or_default();
            gpu.pods_unknown.clone_from(&unknown);
            gpu.offered = offered.as_ref().map(|o| o.contains(&gpu.uuid));
        }
    }

    /// This node's DRA devices, with the `uuid` attribute of those that have one.
    async fn resource_slices(
        &self,
        node: &Node,
    ) -> Result<BTreeMap<DraDevice, Option<String>>, String> {
        let api: Api<ResourceSlice> = Api::all(self.client.clone());
        let params = ListParams::default().fields(&format!("spec.nodeName={}", node.name_any()));
        let slices = tokio::time::timeout(self.deadline, api.list(&params))
            .await
            .map_err(|_| format!("no answer within {:?}", self.deadline))?
            .map_err(|e| e.to_string())?;
        let mut devices = BTreeMap::new();
        for slice in slices {
            let spec = &slice.spec;
            for device in spec.devices.iter().flatten() {
                let uuid = device.attributes.as_ref().and_then(|a| {
                    a.get("uuid")
                        .or_else(|| a.get(&format!("{}/uuid", spec.driver)))
                        .and_then(|v| v.string.clone())
                });
                devices.insert(
                    (
                        spec.driver.clone(),
                        spec.pool.name.clone(),
                        device.name.clone(),
                    ),
                    uuid,
                );
            }
        }
        Ok(devices)
    }

    /// The recovery actions NVML reads, so that one going back to 0 is
    /// recorded as a recovery.
    fn observe_recoveries(&mut self, readings: &[DeviceReading]) {
        let now = Timestamp::now();
        for r in readings.iter().filter(|r| !r.uuid.is_empty()) {
            if let Some(action) = r.recovery_action
                && let Err(e) = self.recoveries.observe(&r.uuid, action, now)
            {
                tracing::warn!(error = %e, "recording a GPU's recovery");
            }
        }
    }
}

impl<G: Gpus> Backend for NvmlBackend<G> {
    fn source(&self) -> &'static str {
        "gpuhealth-agent/nvml"
    }

    fn capabilities(&self, _node: &Node) -> Capabilities {
        self.checks.published(self.nvml_answers, &self.reboot)
    }

    async fn read(&mut self, node: &Node) -> Result<Vec<GpuEntry>, String> {
        self.checks
            .refresh(Some(&self.reset.nvidia_smi), &self.reboot)
            .await;
        let read = self.gpus.read().await;
        self.nvml_answers = read.is_ok();
        let readings = read.map_err(|e| e.to_string())?;
        self.observe_recoveries(&readings);
        let mut gpus: Vec<GpuEntry> = readings.iter().map(nvml::entry).collect();
        self.add_xids(&mut gpus);
        self.add_pods(node, &readings, &mut gpus).await;
        Ok(gpus)
    }

    async fn reset(&mut self, node: &Node, _id: &str, gpus: &[String]) -> Done {
        let (outcome, mut message) =
            reset::reset(&self.gpus, &self.reset, &self.client, node, gpus).await;
        if outcome == Outcome::Succeeded {
            let now = Timestamp::now();
            for uuid in gpus {
                if let Err(e) = self.recoveries.recovered(uuid, now) {
                    message.push_str(&format!("; recording the recovery: {e}"));
                }
            }
        }
        (outcome, message)
    }

    async fn reboot(&mut self, _node: &Node, _id: &str) -> Done {
        self.reboot.reboot().await
    }

    async fn tidy(&mut self, node: &Node) {
        let paused = self.reset.operands.left_paused();
        if paused.is_empty() {
            return;
        }
        match self
            .reset
            .operands
            .restore(&self.client, &node.name_any(), &paused)
            .await
        {
            Ok(()) => {
                tracing::info!(labels = ?paused, "restored the GPU Operator's operands an earlier reset paused")
            }
            Err(e) => {
                tracing::warn!(error = %e, "restoring the GPU Operator's operands; will retry")
            }
        }
    }
}

/// The backend for a node where only the kernel log is read (`--backend
/// kmsg`, chosen by hand): the GPUs as the log describes them. It cannot
/// reset (that needs NVML), and says so in its report.
pub struct KmsgBackend {
    pub kernel_log: Feed,
    pub reboot: RebootMethod,
    pub checks: CapabilityChecks,
}

impl Backend for KmsgBackend {
    fn source(&self) -> &'static str {
        "gpuhealth-agent/kmsg"
    }

    fn capabilities(&self, _node: &Node) -> Capabilities {
        self.checks.published(false, &self.reboot)
    }

    async fn read(&mut self, _node: &Node) -> Result<Vec<GpuEntry>, String> {
        self.checks.refresh(None, &self.reboot).await;
        Ok(self.kernel_log.with(|log| log.entries()))
    }

    async fn reset(&mut self, _node: &Node, _id: &str, _gpus: &[String]) -> Done {
        (
            Outcome::Refused,
            "this agent reads the kernel log only (--backend kmsg) and cannot reset a GPU".into(),
        )
    }

    async fn reboot(&mut self, _node: &Node, _id: &str) -> Done {
        self.reboot.reboot().await
    }
}
