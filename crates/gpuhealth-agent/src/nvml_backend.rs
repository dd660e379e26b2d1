//! The backend of a real GPU node: NVML (on its own thread) for the GPUs'
//! state, the kernel log for their Xids, the kubelet's PodResources for who
//! holds each (the reporter's side); `nvidia-smi` for resets, and the
//! configured way to reboot (the executor's). The two sides meet only
//! through [`crate::handoff`], so that each runs as a process of its own.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use gpuhealth_api::contract::{Capabilities, GpuEntry, Outcome};
use k8s_openapi::{
    api::{core::v1::Node, resource::v1::ResourceSlice},
    jiff::Timestamp,
};
use kube::{Api, Client, ResourceExt, api::ListParams};

use crate::{
    backend::Backend,
    capability_checks::{CapabilityChecks, Offered, Offering, ResetNeeds},
    done::Done,
    handoff::Handoff,
    kmsg::{Feed, PciAddress},
    node_agent::REQUEST_MAY_TAKE,
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
    /// The executor's files, read by the reporter.
    handoff: Handoff,
    /// The executor's side: what it checked it can carry out, offered.
    offering: Offering,
    /// The reporter's side: what the report offers.
    offered: Offered,
    /// Whether the reporter has let go of NVML for the executor's reset.
    standing_aside: bool,
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
        handoff: Handoff,
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
            offering: Offering::new(handoff.clone()),
            offered: Offered::new(handoff.clone()),
            handoff,
            standing_aside: false,
            dra: BTreeMap::new(),
        }
    }

    /// Each GPU's Xids from the kernel log and NVML's events, matched by PCI
    /// address, less those its last recovery answered; each new one named
    /// the pod's that alone held the GPU (`gpu.pods`, read first).
    fn add_xids(&self, gpus: &mut [GpuEntry]) {
        let Some(feed) = &self.kernel_log else { return };
        let now = Timestamp::now();
        feed.with(|log| {
            for gpu in gpus.iter_mut() {
                if let Some(pci) = PciAddress::parse(&gpu.pci_bus_id) {
                    let holders = if gpu.pods_unknown.is_some() {
                        &[][..]
                    } else {
                        &gpu.pods[..]
                    };
                    log.attribute(&pci, holders, now);
                    let asks_recovery = gpu.recovery_action.is_some_and(|a| a != 0);
                    gpu.xids = self
                        .recoveries
                        .fresh(&gpu.uuid, &log.xids(&pci, now, asks_recovery));
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

    /// The executor's resets, then the recovery actions NVML reads, so
    /// that one going back to 0 is recorded as a recovery.
    fn observe_recoveries(&mut self, readings: &[DeviceReading]) {
        match self.handoff.resets() {
            Ok(resets) => {
                for (uuid, at) in resets {
                    if let Err(e) = self.recoveries.reset(&uuid, at) {
                        tracing::warn!(error = %e, "recording a GPU's reset");
                    }
                }
            }
            Err(e) => tracing::warn!(error = %e, "reading the executor's resets"),
        }
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
        self.offered.capabilities()
    }

    async fn read(&mut self, node: &Node) -> Result<Vec<GpuEntry>, String> {
        let read = self.gpus.read().await;
        self.offered.refresh(read.is_ok());
        let readings = read.map_err(|e| e.to_string())?;
        self.observe_recoveries(&readings);
        let mut gpus: Vec<GpuEntry> = readings.iter().map(nvml::entry).collect();
        self.add_pods(node, &readings, &mut gpus).await;
        self.add_xids(&mut gpus);
        Ok(gpus)
    }

    async fn stand_aside(&mut self) -> bool {
        let asked = self.handoff.asked_to_let_go();
        if asked != self.standing_aside {
            let done = if asked {
                self.gpus.release().await
            } else {
                self.gpus.retake().await
            };
            match done {
                Ok(()) if asked => tracing::info!("let go of NVML for the executor's reset"),
                Ok(()) => tracing::info!("took NVML back after the executor's reset"),
                Err(e) => {
                    tracing::warn!(error = %e, asked, "letting go of NVML, or taking it back")
                }
            }
            self.standing_aside = asked;
        }
        asked
    }

    async fn reset(&mut self, node: &Node, id: &str, gpus: &[String]) -> Done {
        self.offering.hold_for(&self.reboot, REQUEST_MAY_TAKE);
        let (outcome, mut message) =
            reset::reset(&self.gpus, &self.reset, &self.client, node, id, gpus).await;
        if outcome == Outcome::Succeeded {
            let now = Timestamp::now();
            for uuid in gpus {
                if let Err(e) = self.handoff.reset_done(uuid, now) {
                    message.push_str(&format!("; recording the recovery: {e}"));
                }
            }
        }
        (outcome, message)
    }

    async fn reboot(&mut self, _node: &Node, _id: &str) -> Done {
        self.offering.hold_for(&self.reboot, REQUEST_MAY_TAKE);
        self.reboot.reboot().await
    }

    /// From NVML alone: the report's read would also ask the kubelet and
    /// record recoveries, neither of which is the executor's.
    async fn gpu_indices(&mut self, _node: &Node, uuids: &[String]) -> Result<Vec<u32>, String> {
        let readings = self.gpus.read().await.map_err(|e| e.to_string())?;
        let known: Vec<(&str, u32)> = readings
            .iter()
            .map(|r| (r.uuid.as_str(), r.index))
            .collect();
        crate::backend::indices_of(&known, uuids)
    }

    fn capability_checks(&self) -> Option<&CapabilityChecks> {
        Some(self.offering.checks())
    }

    async fn tidy(&mut self, node: &Node) {
        let needs = ResetNeeds {
            nvidia_smi: &self.reset.nvidia_smi,
            proc: &self.reset.proc_dir,
        };
        self.offering.renew(Some(needs), &self.reboot).await;
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
    offering: Offering,
    offered: Offered,
}

impl KmsgBackend {
    pub fn new(kernel_log: Feed, reboot: RebootMethod, handoff: Handoff) -> KmsgBackend {
        KmsgBackend {
            kernel_log,
            reboot,
            offering: Offering::new(handoff.clone()),
            offered: Offered::new(handoff),
        }
    }
}

impl Backend for KmsgBackend {
    fn source(&self) -> &'static str {
        "gpuhealth-agent/kmsg"
    }

    fn capabilities(&self, _node: &Node) -> Capabilities {
        self.offered.capabilities()
    }

    async fn read(&mut self, _node: &Node) -> Result<Vec<GpuEntry>, String> {
        self.offered.refresh(false);
        Ok(self.kernel_log.with(|log| log.entries(Timestamp::now())))
    }

    fn capability_checks(&self) -> Option<&CapabilityChecks> {
        Some(self.offering.checks())
    }

    async fn tidy(&mut self, _node: &Node) {
        self.offering.renew(None, &self.reboot).await;
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
