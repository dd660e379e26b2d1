//! The simulated hardware of a KWOK node: the fake backend reads it from the
//! Node's `gpuhealth.io/sim-hardware` annotation, and carries out requests
//! on it.

use gpuhealth_api::{
    GpuHealth,
    contract::{Capabilities, GpuEntry, Outcome, RebootMethod},
};
use k8s_openapi::{api::core::v1::Node, jiff::Timestamp};
use kube::{Api, Client, ResourceExt, api::Patch};
use prometheus_client::metrics::{counter::Counter, family::Family};
use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::{backend::Backend, done::Done, metrics::CodeLabels};

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
    /// How long a reset runs before it ends as `reset` says (a real one
    /// takes seconds); none: at once. A test judges who held the GPU
    /// meanwhile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reset_takes: Option<gpuhealth_api::Duration>,
    /// Every request id the simulated hardware carried out, in order: what
    /// a test counts to prove none ran twice.
    #[serde(default)]
    pub executed: Vec<String>,
    /// What the simulated agent says it can carry out (default: resets,
    /// and reboots through logind).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capabilities: Option<Capabilities>,
}

/// What an agent on simulated hardware can do unless the hardware says.
pub const SIM_CAPABILITIES: Capabilities = Capabilities {
    reset: true,
    reboot: RebootMethod::Logind,
};

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

    /// Records request `id` as carried out and heals `which` GPUs if the
    /// hardware says it works, in one write guarded by the resourceVersion
    /// read: a write by someone else meanwhile (a test changing the
    /// hardware) refuses it with 409 and the change is made again on what
    /// is there now, so that no record of an execution is ever lost.
    async fn carry_out(
        &self,
        node: &Node,
        id: &str,
        outcome: impl Fn(&SimHardware) -> SimOutcome,
        which: impl Fn(&GpuEntry) -> bool,
    ) -> Result<bool, String> {
        let api = Api::<Node>::all(self.client.clone());
        let mut current = node.clone();
        loop {
            let mut hw = Self::hardware(&current)?;
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
            let value = serde_json::to_string(&hw).map_err(|e| e.to_string())?;
            let patch = json!({"metadata": {
                "resourceVersion": current.resource_version(),
                "annotations": {SIM_HARDWARE_ANNOTATION: value},
            }});
            match api
                .patch(
                    &node.name_any(),
                    &crate::patch_params(),
                    &Patch::Merge(patch),
                )
                .await
            {
                Ok(_) => return Ok(works),
                Err(kube::Error::Api(e)) if e.code == 409 => {
                    current = api.get(&node.name_any()).await.map_err(|e| e.to_string())?;
                }
                Err(e) => return Err(e.to_string()),
            }
        }
    }
}

impl Backend for FakeBackend {
    fn source(&self) -> &'static str {
        "gpuhealth-agent/fake"
    }

    fn capabilities(&self, node: &Node) -> Capabilities {
        Self::hardware(node)
            .ok()
            .and_then(|h| h.capabilities)
            .unwrap_or(SIM_CAPABILITIES)
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
        if let Some(takes) = Self::hardware(node).ok().and_then(|h| h.reset_takes) {
            tokio::time::sleep(takes.as_std()).await;
        }
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
                        &crate::patch_params(),
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
