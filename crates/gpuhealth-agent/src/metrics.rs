//! The agent's Prometheus metrics (prefix `gpuhealth_agent_`).

use std::sync::atomic::{AtomicBool, Ordering};

use gpuhealth_api::GpuHealth;
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CodeLabels {
    pub code: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct HealthLabels {
    pub health: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    pub kind: String,
    pub outcome: String,
}

pub struct AgentMetrics {
    registry: Registry,
    pub xids: Family<CodeLabels, Counter>,
    pub gpus: Family<HealthLabels, Gauge>,
    pub reads: Family<ResultLabels, Counter>,
    pub report_writes: Counter,
    pub requests: Family<RequestLabels, Counter>,
    /// Requests to the Kubernetes API, by verb, resource and code.
    pub api_requests: gpuhealth_http::api_requests::ApiRequests,
    /// The GPUs have been read and the report published at least once.
    pub ready: AtomicBool,
}

const HEALTHS: [GpuHealth; 5] = [
    GpuHealth::Healthy,
    GpuHealth::Degraded,
    GpuHealth::ResetRequired,
    GpuHealth::RebootRequired,
    GpuHealth::Lost,
];

impl Default for AgentMetrics {
    fn default() -> Self {
        let mut m = AgentMetrics {
            registry: Registry::with_prefix("gpuhealth_agent"),
            xids: Family::default(),
            gpus: Family::default(),
            reads: Family::default(),
            report_writes: Counter::default(),
            requests: Family::default(),
            api_requests: Default::default(),
            ready: AtomicBool::new(false),
        };
        let r = &mut m.registry;
        r.register(
            "xids",
            "Xids seen in the kernel log, by code",
            m.xids.clone(),
        );
        r.register(
            "gpus",
            "GPUs on this node by health, as last read",
            m.gpus.clone(),
        );
        r.register("reads", "Reads of the GPUs, by result", m.reads.clone());
        r.register(
            "report_writes",
            "Writes of the GPU report to the Node (only when it changed)",
            m.report_writes.clone(),
        );
        r.register(
            "api_requests",
            "Requests to the Kubernetes API, by verb, resource and HTTP status code",
            m.api_requests.clone(),
        );
        r.register(
            "requests",
            "Reset and reboot requests answered, by kind and outcome",
            m.requests.clone(),
        );
        m
    }
}

impl AgentMetrics {
    pub fn set_gpus(&self, healths: impl Iterator<Item = GpuHealth>) {
        let healths: Vec<GpuHealth> = healths.collect();
        for h in HEALTHS {
            let n = healths.iter().filter(|x| **x == h).count();
            self.gpus
                .get_or_create(&HealthLabels {
                    health: format!("{h:?}"),
                })
                .set(n as i64);
        }
    }
}

impl gpuhealth_http::Exposition for AgentMetrics {
    fn registry(&self) -> &Registry {
        &self.registry
    }

    fn ready(&self) -> Result<(), String> {
        if self.ready.load(Ordering::Relaxed) {
            Ok(())
        } else {
            Err("the GPUs have not been read and reported yet".into())
        }
    }
}
