//! A small in-memory world for driving the engine through scenarios: it
//! applies the engine's actions the way the operator and a cooperative agent
//! would, and records every one of them, and everything the engine said.
//!
//! Long because it stands in for every side of a node at once (the API
//! server, the agent's reset, reboot and diagnostic, the pods), and each
//! scenario file needs all of them.

#![allow(dead_code)]

use std::{collections::BTreeMap, time::Duration};

use gpuhealth_api::{
    GpuHealth,
    contract::{
        AnnotationValue, DiagnosticTest, DiagnosticsRequest, DiagnosticsResult, DiagnosticsVerdict,
        DisruptionTolerance, GPU_HEALTHY_CONDITION, GpuReport, Outcome, RequestId, RequestResult,
        ResetRequest, TestVerdict,
    },
    node_health::GpuNodeHealthStatus,
    policy::GpuHealthPolicySpec,
    vocabulary::Reason,
};
use gpuhealth_engine::{
    budget::Budget,
    diagnosis::ObservedCondition,
    drain::{BudgetView, GpuGate, PodView},
    fence::{DeviceView, DraView, RuleView},
    gangs::{GangView, GangWindow},
    guardrails::Guardrails,
    happening::Happening,
    machine::ValidationView,
    machine::{
        Action, BudgetNeeded, Gone, Input, NodeView, NotEnforced, RecordSeal, node_deleted, step,
    },
    workload::WorkloadView,
};
use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::{SignedDuration, Timestamp},
};

pub const INCIDENT_REPORT: &str =
    include_str!("../../../gpuhealth-api/tests/fixtures/incident-gpu-report.json");
pub const BAD_GPU: &str = "GPU-0a1b2c3d-0000-4000-8000-000000000007";

pub fn ts(s: &str) -> Timestamp {
    s.parse().expect("timestamp")
}

pub fn gpu_pod(name: &str, gpu: &str) -> PodView {
    PodView {
        namespace: "ml-serving".into(),
        name: name.into(),
        labels: BTreeMap::new(),
        daemon: false,
        mirror: false,
        terminating: false,
        finished: false,
        requests_gpu: true,
        gpus: vec![gpu.into()],
        tolerance: Ok(DisruptionTolerance::Evict),
        workload: Some(format!("ReplicaSet/ml-serving/{name}-rs")),
        gpu_gate: GpuGate::NotOptedIn,
        gang: None,
        evict_at: None,
    }
}

/// How the simulated agent answers requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Agent {
    Succeeds,
    Fails,
    /// Never answers (for timeouts).
    Silent,
}

pub struct World {
    pub now: Timestamp,
    pub spec: GpuHealthPolicySpec,
    pub node: NodeView,
    pub pods: Vec<PodView>,
    pub disruption_budgets: Vec<BudgetView>,
    /// The gangs of the node's pods, with their members on every node, as
    /// the operator reads them when the step needs them.
    pub gangs: Vec<GangView>,
    /// Gangs other nodes' incidents are taking down now.
    pub gang_windows: Vec<GangWindow>,
    /// Gang members deleted (by `EvictGangMember`), in order.
    pub gang_evicted: Vec<gpuhealth_api::vocabulary::PodKey>,
    /// The validation pod: created by the action, its phase set by a test.
    pub validation: Option<ValidationView>,
    /// The API server refuses the validation pod (an invalid template).
    pub refuse_validation_pod: bool,
    pub state: GpuNodeHealthStatus,
    /// The pods of the workloads the engine watches after a recovery.
    pub workloads: Vec<WorkloadView>,
    pub budget: Budget,
    /// How many steps asked for the budget (stopped without one).
    pub budget_asked: u32,
    pub reset_agent: Agent,
    pub reboot_agent: Agent,
    /// How the executor's DCGM diagnostic ends; None: never answered.
    pub diagnostics_verdict: Option<DiagnosticsVerdict>,
    /// Every action carried out, in order.
    pub log: Vec<Action>,
    /// What the last reconcile said (its Events and metrics).
    pub happenings: Vec<Happening>,
    /// Everything said since the world began, in order.
    pub said: Vec<Happening>,
    /// When the last reconcile asked to be run again.
    pub requeue: Option<Duration>,
    /// Request ids the agent carried out.
    pub executed: Vec<RequestId>,
    /// Labels the engine set on the node.
    pub labels: BTreeMap<String, String>,
    /// Uncordons the API server refuses next (a 409: someone else wrote
    /// the node since the decision).
    pub refused_uncordons: u32,
    boots: u32,
    /// How far the agent's clock is from the operator's (its reports and
    /// results are stamped by it).
    pub agent_clock: SignedDuration,
    /// The diagnostics request last written.
    pub diagnostics_asked: Option<DiagnosticsRequest>,
    /// Why the install's admission protection is missing, if it is.
    pub unprotected: Option<String>,
    /// The cluster's bounds on every policy (none, unless a test sets some).
    pub guardrails: Guardrails,
    /// What the operator finds of the stored record's seal: its own, as
    /// every record the world keeps was written by the step.
    pub seal: RecordSeal,
    /// The report's `observedAt` as last seen, and when (by the operator's
    /// clock), as the operator keeps it.
    report_seen: Option<(Timestamp, Timestamp)>,
}

impl World {
    /// The incident: GPU 7 of an 8-GPU node needs a reset; eight vLLM pods,
    /// one per GPU.
    pub fn incident() -> World {
        let report = GpuReport::parse(INCIDENT_REPORT).expect("fixture");
        let pods = report
            .gpus
            .iter()
            .map(|g| gpu_pod(&format!("vllm-{}", g.index), &g.uuid))
            .collect();
        let spec = GpuHealthPolicySpec::for_selector(Default::default());
        let budget = Budget::new(&spec, 10, 0, 1);
        World {
            now: ts("2026-05-29T08:25:00Z"),
            spec,
            node: NodeView {
                name: "192.168.1.1".into(),
                unschedulable: false,
                cordoned_by: None,
                boot_id: "boot-1".into(),
                conditions: Vec::new(),
                report: Some(Ok(report)),
                reset_request: None,
                reboot_request: None,
                diagnostics_request: None,
                result: None,
                disrupted_by: Vec::new(),
                maintenance: None,
                report_refreshed_at: None,
                report_awaited_since: None,
                break_glass: None,
                dra: None,
                gpu_resource: None,
                unhealthy_devices: Vec::new(),
            },
            pods,
            disruption_budgets: Vec::new(),
            gangs: Vec::new(),
            gang_windows: Vec::new(),
            gang_evicted: Vec::new(),
            validation: None,
            refuse_validation_pod: false,
            state: GpuNodeHealthStatus::default(),
            workloads: Vec::new(),
            budget,
            budget_asked: 0,
            reset_agent: Agent::Succeeds,
            reboot_agent: Agent::Succeeds,
            diagnostics_verdict: Some(DiagnosticsVerdict::Pass),
            log: Vec::new(),
            happenings: Vec::new(),
            said: Vec::new(),
            requeue: None,
            executed: Vec::new(),
            labels: BTreeMap::new(),
            refused_uncordons: 0,
            boots: 1,
            agent_clock: SignedDuration::ZERO,
            diagnostics_asked: None,
            unprotected: None,
            guardrails: Guardrails::none(),
            seal: RecordSeal::Verified,
            report_seen: None,
        }
    }

    pub fn advance(&mut self, d: Duration) {
        self.now = self.now.saturating_add(d).expect("time");
    }

    /// One reconcile: step, persist the status, carry out the actions and
    /// keep what it said (in `happenings`, and in `said`); returns the actions.
    pub fn reconcile(&mut self) -> Vec<Action> {
        if let Some(Ok(report)) = &self.node.report {
            let observed = report.observed_at.0;
            if self.report_seen.is_none_or(|(o, _)| o != observed) {
                self.report_seen = Some((observed, self.now));
            }
            self.node.report_refreshed_at = self.report_seen.map(|(_, at)| at);
        }
        // As the operator steps: without the budget first, counting it only
        // when the step asks. A step that does not ask must decide exactly
        // as it would with the budget counted.
        let input = |budget| Input {
            now: self.now,
            policy: "gpu-nodes",
            spec: &self.spec,
            node: &self.node,
            pods: &self.pods,
            disruption_budgets: &self.disruption_budgets,
            gangs: &self.gangs,
            gang_windows: &self.gang_windows,
            validation: self.validation.as_ref(),
            workloads: &self.workloads,
            budget,
            state: &self.state,
            not_enforced: self.unprotected.as_deref().map(|why| NotEnforced {
                reason: Reason::Unprotected,
                why,
            }),
            guardrails: &self.guardrails,
            seal: self.seal,
        };
        let counted = step(&input(Some(self.budget))).expect("a counted budget is never asked for");
        match step(&input(None)) {
            Ok(uncounted) => assert_eq!(
                uncounted, counted,
                "a step that did not ask for the budget decided otherwise with it"
            ),
            Err(BudgetNeeded) => self.budget_asked += 1,
        }
        let decision = counted;
        self.requeue = decision.requeue_after;
        self.state = decision.status;
        for action in &decision.actions {
            self.apply(action);
        }
        self.log.extend(decision.actions.iter().cloned());
        self.said.extend(decision.happenings.iter().cloned());
        self.happenings = decision.happenings;
        decision.actions
    }

    /// The Node is deleted: the operator's step for a gone node, with the
    /// rules of gpuhealth's still up for it; a decision is persisted and
    /// carried out as `reconcile` does.
    pub fn node_deleted(&mut self) -> Gone {
        let rules = self.node.dra.as_ref().map(|d| d.rules.clone());
        let gone = node_deleted(self.now, "gpu-nodes", &self.spec, rules, &self.state);
        if let Gone::Record(decision) = &gone {
            self.state = decision.status.clone();
            for action in &decision.actions {
                self.apply(action);
            }
            self.log.extend(decision.actions.iter().cloned());
            self.said.extend(decision.happenings.iter().cloned());
            self.happenings = decision.happenings.clone();
        }
        gone
    }

    /// Reconciles at least once, then until `done` holds, failing if the
    /// clock passes `limit`; the clock moves 10 s a round.
    pub fn run_until(&mut self, done: impl Fn(&World) -> bool, limit: Duration) {
        let deadline = self.now.saturating_add(limit).expect("time");
        loop {
            self.reconcile();
            if done(self) {
                return;
            }
            self.agent_turn();
            self.advance(Duration::from_secs(10));
            assert!(
                self.now < deadline,
                "not done by the deadline; state: {:#?}",
                self.state
            );
        }
    }

    fn apply(&mut self, action: &Action) {
        match action {
            Action::Cordon { incident } => {
                self.node.unschedulable = true;
                self.node.cordoned_by = Some(incident.clone());
            }
            Action::Uncordon { .. } if self.refused_uncordons > 0 => {
                self.refused_uncordons -= 1;
            }
            Action::Uncordon { incident } => {
                if self.node.cordoned_by.as_ref() == Some(incident) {
                    self.node.unschedulable = false;
                    self.node.cordoned_by = None;
                }
            }
            // The Eviction API refuses what a budget at zero covers (429).
            Action::Evict { pod }
                if self
                    .disruption_budgets
                    .iter()
                    .any(|b| b.allowed <= 0 && b.pods.contains(pod)) => {}
            Action::TellGangMember { pod, at, .. } => {
                let told = self.pods.iter_mut().chain(
                    self.gangs
                        .iter_mut()
                        .flat_map(|g| g.members.iter_mut().map(|m| &mut m.pod)),
                );
                for p in told.filter(|p| &p.key() == pod) {
                    p.evict_at = Some(*at);
                }
            }
            Action::EvictGangMember { pod, .. } => {
                self.gang_evicted.push(pod.clone());
                self.remove_pod(pod);
            }
            Action::Evict { pod } | Action::ForceDelete { pod } => self.remove_pod(pod),
            Action::RequestReset {
                id,
                gpus,
                requested_at,
            } => {
                // What the agent would read: a request it refuses is no request.
                let request = ResetRequest {
                    id: id.clone(),
                    gpus: gpus.clone(),
                    requested_at: Time(*requested_at),
                };
                if let Err(e) = request.check() {
                    panic!("the engine made a reset request the agent refuses: {e}");
                }
                self.node.reset_request = Some(id.clone());
            }
            Action::RequestReboot { id, .. } => self.node.reboot_request = Some(id.clone()),
            Action::RequestDiagnostics {
                id,
                gpus,
                level,
                timeout,
                requested_at,
            } => {
                let request = DiagnosticsRequest {
                    id: id.clone(),
                    gpus: gpus.clone(),
                    level: *level,
                    timeout: *timeout,
                    requested_at: Time(*requested_at),
                };
                if let Err(e) = request.check() {
                    panic!("the engine made a diagnostics request the agent refuses: {e}");
                }
                self.diagnostics_asked = Some(request);
                self.node.diagnostics_request = Some(id.clone());
            }
            Action::CreateValidationPod { .. } if self.refuse_validation_pod => {}
            Action::CreateValidationPod { .. } => {
                self.validation.get_or_insert(ValidationView {
                    phase: "Pending".into(),
                    message: String::new(),
                });
            }
            Action::DeleteValidationPod { .. } => self.validation = None,
            Action::SetGpuHealthy { pod, healthy, .. } => {
                for p in self.pods.iter_mut().filter(|p| &p.key() == pod) {
                    p.gpu_gate = GpuGate::Is(*healthy);
                }
            }
            Action::LabelNode { key, value } => {
                self.labels.insert(key.clone(), value.clone());
            }
            Action::ClearBreakGlass => self.node.break_glass = None,
            Action::MarkGpuHealthUnknown { .. } => {
                self.node
                    .conditions
                    .retain(|c| c.type_ != GPU_HEALTHY_CONDITION);
                self.node.conditions.push(ObservedCondition {
                    type_: GPU_HEALTHY_CONDITION.into(),
                    status: "Unknown".into(),
                    last_transition: self.now,
                });
            }
            Action::ForgetCordonRecord { incident } => {
                assert!(
                    !self.node.unschedulable,
                    "a record forgotten on a cordoned node"
                );
                assert_eq!(self.node.cordoned_by.as_ref(), Some(incident));
                self.node.cordoned_by = None;
            }
            Action::TaintDevice { rule, incident, .. } => {
                let dra = self
                    .node
                    .dra
                    .as_mut()
                    .expect("a rule only where DRA is served");
                if !dra.rules.iter().any(|r| &r.name == rule) {
                    dra.rules.push(RuleView {
                        name: rule.clone(),
                        incident: incident.clone(),
                        created: Some(self.now),
                    });
                }
            }
            Action::UntaintDevice { rule } => {
                if let Some(dra) = self.node.dra.as_mut() {
                    dra.rules.retain(|r| &r.name != rule);
                }
            }
        }
    }

    /// A pod gone from the node, its gang and the report.
    fn remove_pod(&mut self, pod: &gpuhealth_api::vocabulary::PodKey) {
        self.pods.retain(|p| &p.key() != pod);
        for g in &mut self.gangs {
            g.members.retain(|m| &m.pod.key() != pod);
        }
        if let Some(Ok(report)) = &mut self.node.report {
            for g in &mut report.gpus {
                g.pods
                    .retain(|p| p.namespace != pod.namespace || p.name != pod.name);
            }
        }
    }

    /// The node's GPUs published as DRA devices, one per GPU with its UUID,
    /// on a cluster that serves DeviceTaintRules.
    pub fn with_dra(mut self) -> World {
        let Some(Ok(report)) = &self.node.report else {
            return self;
        };
        let devices = report
            .gpus
            .iter()
            .map(|g| DeviceView {
                driver: "gpu.nvidia.com".into(),
                pool: self.node.name.clone(),
                name: format!("gpu-{}", g.index),
                uuid: Some(g.uuid.clone()),
                taints: Vec::new(),
            })
            .collect();
        self.node.dra = Some(DraView {
            can_taint: true,
            devices,
            rules: Vec::new(),
        });
        self
    }

    /// The rules of gpuhealth's now up on the node.
    pub fn rules(&self) -> Vec<String> {
        self.node
            .dra
            .as_ref()
            .map(|d| d.rules.iter().map(|r| r.name.clone()).collect())
            .unwrap_or_default()
    }

    /// The agent remembers what it carried out and never repeats an id.
    fn answered(&self, id: &RequestId) -> bool {
        self.executed.iter().any(|e| e == id)
    }

    /// The agent carries out a pending request once and reports; a
    /// successful reset or reboot leaves a healthy, fresh report.
    pub fn agent_turn(&mut self) {
        self.diagnose();
        if let Some(id) = self.node.reset_request.clone()
            && !self.answered(&id)
            && self.reset_agent != Agent::Silent
        {
            self.executed.push(id.clone());
            let ok = self.reset_agent == Agent::Succeeds;
            self.answer(&id, ok);
            if ok {
                self.heal();
            }
        }
        if let Some(id) = self.node.reboot_request.clone()
            && !self.answered(&id)
            && self.reboot_agent != Agent::Silent
        {
            self.executed.push(id.clone());
            let ok = self.reboot_agent == Agent::Succeeds;
            self.answer(&id, ok);
            if ok {
                self.boots += 1;
                self.node.boot_id = format!("boot-{}", self.boots);
                self.heal();
            }
        }
    }

    /// The executor's diagnostic: each asked GPU's memory test, the one
    /// verdict the world was given.
    fn diagnose(&mut self) {
        let Some(request) = self.diagnostics_asked.clone() else {
            return;
        };
        let Some(verdict) = self.diagnostics_verdict else {
            return;
        };
        if self.answered(&request.id) {
            return;
        }
        self.executed.push(request.id.clone());
        let test = match verdict {
            DiagnosticsVerdict::Pass => Some(TestVerdict::Pass),
            DiagnosticsVerdict::Warn => Some(TestVerdict::Warn),
            DiagnosticsVerdict::Fail => Some(TestVerdict::Fail),
            DiagnosticsVerdict::TimedOut | DiagnosticsVerdict::Error => None,
        };
        let tests = test.map_or_else(Vec::new, |verdict| {
            request
                .gpus
                .iter()
                .map(|g| DiagnosticTest {
                    name: "memory".into(),
                    gpu: Some(g.clone()),
                    verdict,
                    detail: None,
                })
                .collect()
        });
        let result = DiagnosticsResult {
            level: request.level,
            verdict,
            dcgm_version: Some("4.2.3".into()),
            tests,
        };
        self.node.result = Some(Ok(RequestResult {
            id: request.id.clone(),
            outcome: if verdict.passed() {
                Outcome::Succeeded
            } else {
                Outcome::Failed
            },
            message: result.summary(),
            finished_at: Time(self.agent_now()),
            diagnostics: Some(result),
        }));
    }

    fn answer(&mut self, id: &RequestId, ok: bool) {
        self.node.result = Some(Ok(RequestResult {
            id: id.clone(),
            outcome: if ok {
                Outcome::Succeeded
            } else {
                Outcome::Failed
            },
            message: if ok {
                String::new()
            } else {
                "nvidia-smi --gpu-reset failed".into()
            },
            finished_at: Time(self.agent_now()),
            diagnostics: None,
        }));
    }

    /// What the agent's clock says now.
    pub fn agent_now(&self) -> Timestamp {
        self.now.saturating_add(self.agent_clock).expect("time")
    }

    /// Every GPU healthy, in a report newer than now (by the agent's clock).
    pub fn heal(&mut self) {
        let observed = self
            .agent_now()
            .saturating_add(Duration::from_secs(1))
            .expect("time");
        if let Some(Ok(report)) = &mut self.node.report {
            report.observed_at = Time(observed);
            for g in &mut report.gpus {
                g.health = GpuHealth::Healthy;
                g.recovery_action = Some(0);
                // A reset or reboot applies the row remaps pending.
                if let Some(rows) = &mut g.remapped_rows {
                    rows.pending = false;
                }
            }
        }
    }

    /// The fault gone, not just answered: every GPU healthy and no Xid left
    /// in the report.
    pub fn clear(&mut self) {
        self.heal();
        if let Some(Ok(report)) = &mut self.node.report {
            report.gpus.iter_mut().for_each(|g| g.xids.clear());
        }
    }

    /// The GPUs each reset request named, in order.
    pub fn reset_requests(&self) -> Vec<Vec<String>> {
        self.log
            .iter()
            .filter_map(|a| match a {
                Action::RequestReset { gpus, .. } => Some(gpus.clone()),
                _ => None,
            })
            .collect()
    }

    /// GPU `index` reported in `health`, in a report observed now.
    pub fn set_gpu_health(&mut self, index: u32, health: GpuHealth) {
        if let Some(Ok(report)) = &mut self.node.report {
            report.observed_at = Time(self.now);
            for g in report.gpus.iter_mut().filter(|g| g.index == index) {
                g.health = health;
            }
        }
    }

    pub fn evicted(&self) -> Vec<String> {
        self.log
            .iter()
            .filter_map(|a| match a {
                Action::Evict { pod } => Some(pod.to_string()),
                _ => None,
            })
            .collect()
    }

    pub fn count(&self, pred: impl Fn(&Action) -> bool) -> usize {
        self.log.iter().filter(|a| pred(a)).count()
    }
}
