//! The agent's Prometheus metrics (prefix `gpuhealth_agent_`).

use std::{
    sync::atomic::{AtomicU64, Ordering},
    time::{Duration, Instant},
};

use gpuhealth_api::GpuHealth;
use parking_lot::Mutex;
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use crate::capability_checks::Check;

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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabels {
    pub kind: String,
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WithheldLabels {
    pub capability: String,
    pub check: String,
}

impl WithheldLabels {
    pub fn of(check: Check) -> WithheldLabels {
        WithheldLabels {
            capability: check.capability().as_str().into(),
            check: check.as_str().into(),
        }
    }
}

pub struct AgentMetrics {
    registry: Registry,
    pub xids: Family<CodeLabels, Counter>,
    /// Kernel log lines that name a GPU as the driver's do but are not
    /// its own: a process may be forging them.
    pub not_the_drivers: Counter,
    pub gpus: Family<HealthLabels, Gauge>,
    pub reads: Family<ResultLabels, Counter>,
    pub report_writes: Counter,
    pub requests: Family<RequestLabels, Counter>,
    /// Requests on the Node that are not the operator's, refused unread.
    pub refused: Family<RefusalLabels, Counter>,
    /// 1 while the executor's check fails and withholds its capability.
    pub withheld: Family<WithheldLabels, Gauge>,
    /// Requests to the Kubernetes API, by verb, resource and code.
    pub api_requests: gpuhealth_http::api_requests::ApiRequests,
    /// Whether the GPUs were read at the last try, or why not.
    readiness: Mutex<Result<(), String>>,
    /// When the loop last went round, and until when it may be busy with a
    /// request, in milliseconds since `started`.
    started: Instant,
    beat_ms: AtomicU64,
    busy_until_ms: AtomicU64,
    /// How long the loop may go without a round before it counts as stuck.
    stall_after_ms: AtomicU64,
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
            not_the_drivers: Counter::default(),
            gpus: Family::default(),
            reads: Family::default(),
            report_writes: Counter::default(),
            requests: Family::default(),
            refused: Family::default(),
            withheld: Family::default(),
            api_requests: Default::default(),
            readiness: Mutex::new(Err("the GPUs have not been read yet".into())),
            started: Instant::now(),
            beat_ms: AtomicU64::new(0),
            busy_until_ms: AtomicU64::new(0),
            stall_after_ms: AtomicU64::new(120_000),
        };
        // Every refusal from the start, at 0: an alert's increase() needs
        // the series before the first one.
        for kind in ["reset", "reboot", "diagnostics"] {
            for reason in crate::authority::Refusal::REASONS {
                drop(m.refused.get_or_create(&RefusalLabels {
                    kind: kind.into(),
                    reason: reason.into(),
                }));
            }
        }
        // Every check at 0 from the start, for the same reason.
        for check in Check::ALL {
            drop(m.withheld.get_or_create(&WithheldLabels::of(check)));
        }
        let r = &mut m.registry;
        r.register(
            "xids",
            "Xids seen in the kernel log, by code",
            m.xids.clone(),
        );
        r.register(
            "kernel_lines_not_the_drivers",
            "Kernel log lines that read like the driver's Xid or GPU lines but are not its own (another facility than the kernel's, or the words elsewhere than where a message starts): not read; a process on the node may be forging them",
            m.not_the_drivers.clone(),
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
            "Reset, reboot and diagnostics requests answered, by kind and outcome",
            m.requests.clone(),
        );
        r.register(
            "requests_refused",
            "Requests on the Node that are not the one its GpuNodeHealth records in flight, by kind and reason",
            m.refused.clone(),
        );
        r.register(
            "capability_withheld",
            "1 while the executor's check fails and it offers no reset or reboot for it, by capability and check",
            m.withheld.clone(),
        );
        m
    }
}

impl AgentMetrics {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// The loop went round; it may now be busy for `busy` (a request).
    pub fn beat(&self, busy: Option<Duration>) {
        let now = self.now_ms();
        self.beat_ms.store(now, Ordering::Relaxed);
        let until = busy.map_or(0, |b| now.saturating_add(b.as_millis() as u64));
        self.busy_until_ms.store(until, Ordering::Relaxed);
    }

    /// How long the loop may go without a round before `/livez` fails.
    pub fn set_stall_after(&self, after: Duration) {
        self.stall_after_ms
            .store(after.as_millis() as u64, Ordering::Relaxed);
    }

    pub fn set_readiness(&self, state: Result<(), String>) {
        *self.readiness.lock() = state;
    }

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
        self.readiness.lock().clone()
    }

    fn live(&self) -> Result<(), String> {
        let now = self.now_ms();
        let since = now.saturating_sub(self.beat_ms.load(Ordering::Relaxed));
        let busy = now < self.busy_until_ms.load(Ordering::Relaxed);
        if busy || since <= self.stall_after_ms.load(Ordering::Relaxed) {
            Ok(())
        } else {
            Err(format!(
                "the agent's loop has not gone round for {}s",
                since / 1000
            ))
        }
    }
}
