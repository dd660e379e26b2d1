//! The operator's Prometheus metrics, served with `/livez` and `/readyz`.

use std::sync::atomic::{AtomicBool, Ordering};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{
        counter::Counter,
        family::Family,
        gauge::Gauge,
        histogram::{Histogram, exponential_buckets},
    },
    registry::Registry,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ErrorLabels {
    /// Where it failed: one of [`crate::error::Stage`].
    pub stage: &'static str,
    /// What went wrong: [`crate::error::Error::metric_label`].
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReportLabels {
    pub policy: String,
    pub error: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ActionLabels {
    pub action: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabels {
    pub policy: String,
    pub phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReportProblemLabels {
    pub policy: String,
    /// `Stale` or `Unreadable`.
    pub problem: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PolicyLabels {
    pub policy: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OutcomeLabels {
    pub policy: String,
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RemediationLabels {
    pub policy: String,
    /// The ladder rung: `GpuReset`, `NodeReboot`.
    pub action: String,
    /// `Succeeded` or `Failed`.
    pub outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FenceLabels {
    pub policy: String,
    /// `DeviceTaintRule` or `DevicePlugin`.
    pub fence: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StageLabels {
    /// One of [`Metrics::STAGES`].
    pub stage: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FindingLabels {
    pub policy: String,
    /// The finding's type.
    pub finding: String,
}

pub struct Metrics {
    registry: Registry,
    pub reconcile_errors: Family<ErrorLabels, Counter>,
    pub reconcile_duration: Histogram,
    /// Where a node reconcile's time goes, by [`Metrics::STAGES`].
    pub reconcile_stages: Family<StageLabels, Histogram, fn() -> Histogram>,
    pub malformed_reports: Family<ReportLabels, Counter>,
    pub actions: Family<ActionLabels, Counter>,
    pub nodes: Family<PhaseLabels, Gauge>,
    pub report_problems: Family<ReportProblemLabels, Gauge>,
    /// Managed nodes with no GPU report at all past their grace, by policy.
    pub nodes_not_reporting: Family<PolicyLabels, Gauge>,
    pub circuit_open: Family<PolicyLabels, Gauge>,
    pub unhonoured_fields: Family<PolicyLabels, Gauge>,
    pub past_guardrails: Family<PolicyLabels, Gauge>,
    pub incidents: Family<OutcomeLabels, Counter>,
    pub remediations: Family<RemediationLabels, Counter>,
    pub findings: Family<FindingLabels, Counter>,
    pub time_to_quarantine: Histogram,
    pub time_to_recovery: Histogram,
    /// GPUs fenced alone now (their node serving), by policy and fence.
    pub gpus_fenced: Family<FenceLabels, Gauge>,
    /// GPU-seconds that went on serving beside fenced GPUs, which a cordon
    /// would have taken out of service.
    pub gpu_seconds_kept: Family<PolicyLabels, Counter<f64, std::sync::atomic::AtomicU64>>,
    pub leader: Gauge,
    /// 1 while the last check found the admission protection in force.
    pub protected: Gauge,
    /// Requests to the Kubernetes API, by verb, resource and code.
    pub api_requests: gpuhealth_http::api_requests::ApiRequests,
    /// Caches synced and leadership settled (held, or waiting for it).
    pub ready: AtomicBool,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut m = Metrics {
            registry: Registry::with_prefix("gpuhealth"),
            reconcile_errors: Family::default(),
            // 1 ms to about 16 s.
            reconcile_duration: Histogram::new(exponential_buckets(0.001, 2.0, 15)),
            reconcile_stages: Family::new_with_constructor(|| {
                // 0.1 ms to about 3 s.
                Histogram::new(exponential_buckets(0.0001, 2.0, 15))
            }),
            malformed_reports: Family::default(),
            actions: Family::default(),
            nodes: Family::default(),
            report_problems: Family::default(),
            nodes_not_reporting: Family::default(),
            circuit_open: Family::default(),
            unhonoured_fields: Family::default(),
            past_guardrails: Family::default(),
            incidents: Family::default(),
            remediations: Family::default(),
            findings: Family::default(),
            // 50 ms to about 14 min.
            time_to_quarantine: Histogram::new(exponential_buckets(0.05, 2.0, 15)),
            // 10 s to about 2 days.
            time_to_recovery: Histogram::new(exponential_buckets(10.0, 2.0, 15)),
            gpus_fenced: Family::default(),
            gpu_seconds_kept: Family::default(),
            leader: Gauge::default(),
            protected: Gauge::default(),
            api_requests: Default::default(),
            ready: AtomicBool::new(false),
        };
        m.series_from_the_start();
        m.register();
        m
    }
}

impl Metrics {
    /// Every error kind and stage from the start, at 0: rate() needs a
    /// series to exist before the first error does.
    fn series_from_the_start(&self) {
        let m = self;
        for (stage, kind) in crate::error::Error::LABELS {
            drop(m.reconcile_errors.get_or_create(&ErrorLabels {
                stage: stage.as_str(),
                kind,
            }));
        }
        for stage in Metrics::STAGES {
            drop(m.reconcile_stages.get_or_create(&StageLabels { stage }));
        }
    }

    /// Every metric, with its help text, under the `gpuhealth` prefix.
    fn register(&mut self) {
        let m = self;
        let r = &mut m.registry;
        r.register(
            "reconcile_errors",
            "Reconciles that failed, by the stage that failed and the kind of error",
            m.reconcile_errors.clone(),
        );
        r.register(
            "reconcile_duration_seconds",
            "Time taken by one node reconcile",
            m.reconcile_duration.clone(),
        );
        r.register(
            "reconcile_stage_seconds",
            "Time taken by each stage of a node reconcile: read (API reads before deciding), wait (for the decisions lock), budget (counting the policy's fleet, for a step about to start), decide (the engine), fence (the cordon or a GPU's rule, before the status), write (the status), act (the other side effects)",
            m.reconcile_stages.clone(),
        );
        r.register(
            "malformed_gpu_reports",
            "GPU report annotations that could not be read and were ignored, by policy and error",
            m.malformed_reports.clone(),
        );
        r.register(
            "actions",
            "Side effects carried out on nodes and pods, by action and outcome",
            m.actions.clone(),
        );
        r.register(
            "nodes",
            "Managed nodes by policy and phase",
            m.nodes.clone(),
        );
        r.register(
            "report_problems",
            "Managed nodes whose GPU report cannot be trusted now, by policy and problem: Stale (not refreshed within detection.gpuReport.staleAfter) or Unreadable (its writer cannot read the GPUs)",
            m.report_problems.clone(),
        );
        r.register(
            "nodes_not_reporting",
            "Managed nodes with no GPU report at all, longer after they were selected than detection.gpuReport.staleAfter, by policy: their agent never reported (not scheduled there, crash-looping, no runtime class, no image for the node's architecture)",
            m.nodes_not_reporting.clone(),
        );
        r.register(
            "circuit_open",
            "1 while the policy's circuit breaker holds new remediations back",
            m.circuit_open.clone(),
        );
        r.register(
            "policy_unhonoured_fields",
            "Fields of the policy the operator cannot honour (an unknown time zone, a lock it may not read); its Ready condition names them",
            m.unhonoured_fields.clone(),
        );
        r.register(
            "policy_past_guardrails",
            "Guardrails of the cluster the policy is past (the operator's --fleet-wide-nodes, --condition-types): while any, it enforces nothing and its Ready condition names them",
            m.past_guardrails.clone(),
        );
        r.register(
            "gpus_fenced",
            "GPUs taken out of service alone, their node serving, by policy and fence (DeviceTaintRule, DevicePlugin)",
            m.gpus_fenced.clone(),
        );
        r.register(
            "gpu_capacity_kept_seconds",
            "GPU-seconds the other GPUs of nodes with a fenced GPU went on serving, which a cordon would have taken out of service, by policy",
            m.gpu_seconds_kept.clone(),
        );
        r.register(
            "incidents",
            "Incidents ended, by policy and outcome (Recovered, Failed, Cancelled)",
            m.incidents.clone(),
        );
        r.register(
            "remediations",
            "Recovery attempts ended, by policy, action (GpuReset, NodeReboot) and outcome (Succeeded, Failed)",
            m.remediations.clone(),
        );
        r.register(
            "findings",
            "Findings recorded (PodOnBadGpu, StartupProbeTooShort, WorkloadNotRecovered, ...), by policy and type",
            m.findings.clone(),
        );
        r.register(
            "time_to_quarantine_seconds",
            "From the GPU report that showed the fault to the cordon",
            m.time_to_quarantine.clone(),
        );
        r.register(
            "time_to_recovery_seconds",
            "From an incident's start to its node back in service",
            m.time_to_recovery.clone(),
        );
        r.register(
            "api_requests",
            "Requests to the Kubernetes API, by verb, resource and HTTP status code",
            m.api_requests.clone(),
        );
        r.register(
            "protected",
            "1 while the last check found gpuhealth's admission policies in force (bound, and refusing a forbidden dry run); 0: nothing is enforced",
            m.protected.clone(),
        );
        r.register(
            "leader",
            "1 while this replica holds the leader Lease and may act",
            m.leader.clone(),
        );
    }
}

impl Metrics {
    /// The stages of a node reconcile, in order; `budget` (counting the
    /// policy's fleet) only for a step about to start a remediation,
    /// `fence` (the cordon or a GPU's rule, before the status) only for one
    /// that quarantines.
    pub const STAGES: [&'static str; 7] =
        ["read", "wait", "budget", "decide", "fence", "write", "act"];

    /// Records that `stage` took from `since` until now; returns now, the
    /// next stage's start.
    pub fn stage(&self, stage: &'static str, since: std::time::Instant) -> std::time::Instant {
        let now = std::time::Instant::now();
        self.reconcile_stages
            .get_or_create(&StageLabels { stage })
            .observe(now.duration_since(since).as_secs_f64());
        now
    }

    pub fn action(&self, action: &str, outcome: &str) {
        self.actions
            .get_or_create(&ActionLabels {
                action: action.into(),
                outcome: outcome.into(),
            })
            .inc();
    }
}

impl gpuhealth_http::Exposition for Metrics {
    fn registry(&self) -> &Registry {
        &self.registry
    }

    fn ready(&self) -> Result<(), String> {
        if self.ready.load(Ordering::Relaxed) {
            Ok(())
        } else {
            Err("caches not synced yet".into())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_prometheus_conventions() {
        let m = Metrics::default();
        m.action("evict", "refused");
        m.malformed_reports
            .get_or_create(&ReportLabels {
                policy: "p".into(),
                error: "json".into(),
            })
            .inc();
        let text = gpuhealth_http::render(&m.registry);
        for name in [
            "gpuhealth_actions_total{action=\"evict\",outcome=\"refused\"} 1",
            "gpuhealth_malformed_gpu_reports_total{policy=\"p\",error=\"json\"} 1",
            "# TYPE gpuhealth_reconcile_duration_seconds histogram",
            "# TYPE gpuhealth_leader gauge",
            "gpuhealth_reconcile_stage_seconds_count{stage=\"wait\"} 0",
        ] {
            assert!(text.contains(name), "{name} missing from:\n{text}");
        }
    }
}
