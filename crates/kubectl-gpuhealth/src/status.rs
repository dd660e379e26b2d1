//! `kubectl gpuhealth status`: the fleet at a glance. Policies with their
//! counts and breakers, nodes per phase, the nodes that are not Healthy,
//! the bad GPUs with the pods on them, and the findings. Built from the two
//! lists alone, so it is tested without a cluster.
//!
//! Long because half of it is the tests of the fleet's summary.

use gpuhealth_api::{
    GpuHealth, GpuHealthPolicy, GpuNodeHealth,
    node_health::{GpuNodeHealthStatus, Phase},
    quarantine::Fenced,
    vocabulary::{FindingKind, FindingSubject, PodKey, PolicyCondition, Reason},
};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use kube::ResourceExt;
use serde::Serialize;

use gpuhealth_engine::fence::gpu_name;

use crate::output::{Paint, Style, ago, table};

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Fleet {
    pub policies: Vec<PolicyLine>,
    /// Managed nodes (`GpuNodeHealth` objects).
    pub nodes: usize,
    /// Nodes per phase, only the phases that have any.
    pub phases: Vec<PhaseCount>,
    pub not_healthy: Vec<NodeLine>,
    pub bad_gpus: Vec<BadGpu>,
    /// Every node's open findings (`GpuNodeHealthStatus::open_findings`), newest first.
    pub findings: Vec<FindingLine>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PolicyLine {
    pub name: String,
    pub mode: String,
    pub nodes: u32,
    pub healthy: u32,
    pub remediating: u32,
    pub failed: u32,
    /// Unset until the operator has written the policy's status.
    pub ready: Option<bool>,
    pub circuit_open: bool,
    pub conflict: bool,
    /// The messages of the conditions that are not as they should be.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PhaseCount {
    pub phase: Phase,
    pub nodes: usize,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeLine {
    pub node: String,
    pub phase: Phase,
    pub since: Option<Time>,
    pub policy: Option<String>,
    pub reason: Option<Reason>,
    pub message: Option<String>,
    /// Indexes of the GPUs not serving.
    pub bad_gpus: Vec<u32>,
    /// The action in flight, as `GpuReset#1`.
    pub action: Option<String>,
    /// What is kept from new work: `node`, or the GPUs fenced alone
    /// (`GPU 7`).
    pub fenced: Option<String>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BadGpu {
    pub node: String,
    pub index: u32,
    pub uuid: String,
    pub health: GpuHealth,
    pub pods: Vec<PodKey>,
    /// How it is kept from new work: `node` (its node is cordoned), or
    /// its own fence (`DeviceTaintRule`, `DevicePlugin`).
    pub fence: Option<String>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct FindingLine {
    pub node: String,
    #[serde(rename = "type")]
    pub type_: FindingKind,
    pub subject: Option<FindingSubject>,
    pub message: String,
    pub observed_at: Time,
}

/// The fleet from every policy and every node health object.
pub fn build(policies: &[GpuHealthPolicy], nodes: &[GpuNodeHealth]) -> Fleet {
    let mut policy_lines: Vec<PolicyLine> = policies.iter().map(policy_line).collect();
    policy_lines.sort_by(|a, b| a.name.cmp(&b.name));

    let mut statuses: Vec<(String, GpuNodeHealthStatus)> = nodes
        .iter()
        .map(|n| (n.name_any(), n.status.clone().unwrap_or_default()))
        .collect();
    statuses.sort_by(|a, b| a.0.cmp(&b.0));

    let phases = Phase::ALL
        .iter()
        .map(|&phase| PhaseCount {
            phase,
            nodes: statuses.iter().filter(|(_, s)| s.phase == phase).count(),
        })
        .filter(|c| c.nodes > 0)
        .collect();

    let mut not_healthy: Vec<NodeLine> = statuses
        .iter()
        .filter(|(_, s)| s.phase != Phase::Healthy)
        .map(|(node, s)| NodeLine {
            node: node.clone(),
            phase: s.phase,
            since: s.phase_since.clone(),
            policy: s.policy.clone(),
            reason: s.reason,
            message: s.message.clone(),
            bad_gpus: s
                .gpus
                .iter()
                .filter(|g| !g.health.is_serving())
                .map(|g| g.index)
                .collect(),
            action: s
                .action
                .as_ref()
                .map(|a| format!("{:?}#{}", a.type_, a.attempt)),
            fenced: fenced(s),
        })
        .collect();
    // The worst first: Failed, then the furthest along.
    not_healthy.sort_by_key(|n| std::cmp::Reverse(phase_rank(n.phase)));

    let bad_gpus = statuses
        .iter()
        .flat_map(|(node, s)| {
            s.gpus
                .iter()
                .filter(|g| !g.health.is_serving())
                .map(|g| BadGpu {
                    node: node.clone(),
                    index: g.index,
                    uuid: g.uuid.clone(),
                    health: g.health,
                    pods: g.pods.clone(),
                    fence: fence_of(s, &g.uuid),
                })
        })
        .collect();

    let mut findings: Vec<FindingLine> = statuses
        .iter()
        .flat_map(|(node, s)| {
            s.open_findings().map(|f| FindingLine {
                node: node.clone(),
                type_: f.type_,
                subject: f.subject.clone(),
                message: f.message.clone(),
                observed_at: f.observed_at.clone(),
            })
        })
        .collect();
    findings.sort_by_key(|f| std::cmp::Reverse(f.observed_at.0));

    Fleet {
        policies: policy_lines,
        nodes: statuses.len(),
        phases,
        not_healthy,
        bad_gpus,
        findings,
    }
}

/// What the node's quarantine keeps from new work, while it holds.
fn fenced(s: &GpuNodeHealthStatus) -> Option<String> {
    let q = s.quarantine.as_ref().filter(|q| q.lifted_at.is_none())?;
    Some(match q.scope {
        Fenced::Node => "node".into(),
        Fenced::Gpu => q.gpus.iter().map(gpu_name).collect::<Vec<_>>().join(", "),
    })
}

/// How GPU `uuid` is kept from new work, if it is.
fn fence_of(s: &GpuNodeHealthStatus, uuid: &str) -> Option<String> {
    let q = s.quarantine.as_ref().filter(|q| q.lifted_at.is_none())?;
    match q.scope {
        Fenced::Node => Some("node".into()),
        Fenced::Gpu => q
            .gpus
            .iter()
            .find(|g| g.uuid == uuid)
            .map(|g| format!("{:?}", g.fence)),
    }
}

fn phase_rank(phase: Phase) -> usize {
    Phase::ALL.iter().position(|p| *p == phase).unwrap_or(0)
}

fn policy_line(p: &GpuHealthPolicy) -> PolicyLine {
    let status = p.status.clone().unwrap_or_default();
    let ready = status
        .condition(PolicyCondition::Ready)
        .map(|c| c.status == "True");
    let mut notes = Vec::new();
    for (type_, bad) in [
        (PolicyCondition::Ready, ready == Some(false)),
        (
            PolicyCondition::CircuitOpen,
            status.is_true(PolicyCondition::CircuitOpen),
        ),
        (
            PolicyCondition::Conflict,
            status.is_true(PolicyCondition::Conflict),
        ),
    ] {
        if let Some(c) = status.condition(type_).filter(|_| bad)
            && !c.message.is_empty()
        {
            notes.push(c.message.clone());
        }
    }
    PolicyLine {
        name: p.name_any(),
        mode: format!("{:?}", p.spec.mode),
        nodes: status.nodes,
        healthy: status.healthy,
        remediating: status.remediating,
        failed: status.failed,
        ready,
        circuit_open: status.is_true(PolicyCondition::CircuitOpen),
        conflict: status.is_true(PolicyCondition::Conflict),
        notes,
    }
}

pub fn phase_paint(phase: Phase) -> Paint {
    match phase {
        Phase::Healthy => Paint::Green,
        Phase::Failed => Paint::Red,
        _ => Paint::Yellow,
    }
}

pub fn health_paint(health: GpuHealth) -> Paint {
    match health {
        GpuHealth::Healthy => Paint::Green,
        GpuHealth::Degraded => Paint::Yellow,
        _ => Paint::Red,
    }
}

/// The fleet as a person reads it. `now` only turns times into ages.
pub fn text(fleet: &Fleet, now: Timestamp, style: Style) -> String {
    let mut out = String::new();
    let plain = |s: String| (s, Paint::Plain);

    out.push_str(&style.bold("Policies"));
    out.push('\n');
    if fleet.policies.is_empty() {
        out.push_str(
            "  none: no GpuHealthPolicy exists, so no node is managed (see config/samples/)\n",
        );
    } else {
        let rows: Vec<Vec<(String, Paint)>> = fleet
            .policies
            .iter()
            .map(|p| {
                let mut state = Vec::new();
                if p.circuit_open {
                    state.push("circuit open");
                }
                if p.conflict {
                    state.push("conflict");
                }
                if p.ready == Some(false) {
                    state.push("not ready");
                }
                let (state, paint) = if state.is_empty() {
                    ("ok".to_owned(), Paint::Green)
                } else {
                    (state.join(", "), Paint::Red)
                };
                vec![
                    plain(p.name.clone()),
                    plain(p.mode.clone()),
                    plain(p.nodes.to_string()),
                    plain(p.healthy.to_string()),
                    plain(p.remediating.to_string()),
                    plain(p.failed.to_string()),
                    (state, paint),
                ]
            })
            .collect();
        out.push_str(&table(
            style,
            "  ",
            &[
                "NAME",
                "MODE",
                "NODES",
                "HEALTHY",
                "REMEDIATING",
                "FAILED",
                "STATE",
            ],
            &rows,
        ));
        for p in &fleet.policies {
            for note in &p.notes {
                out.push_str(&format!("  {}: {note}\n", p.name));
            }
        }
    }

    let per_phase: Vec<String> = fleet
        .phases
        .iter()
        .map(|c| {
            let phase = format!("{:?}", c.phase);
            format!("{} {}", c.nodes, style.apply(phase_paint(c.phase), &phase))
        })
        .collect();
    out.push('\n');
    out.push_str(&style.bold(&format!("Nodes: {}", fleet.nodes)));
    if !per_phase.is_empty() {
        out.push_str(&format!(" ({})", per_phase.join(", ")));
    }
    out.push('\n');

    if !fleet.not_healthy.is_empty() {
        out.push('\n');
        out.push_str(&style.bold("Not healthy"));
        out.push('\n');
        let rows: Vec<Vec<(String, Paint)>> = fleet
            .not_healthy
            .iter()
            .map(|n| {
                let gpus: Vec<String> = n.bad_gpus.iter().map(u32::to_string).collect();
                vec![
                    plain(n.node.clone()),
                    (format!("{:?}", n.phase), phase_paint(n.phase)),
                    plain(n.since.as_ref().map_or("-".into(), |t| ago(now, t.0))),
                    plain(n.policy.clone().unwrap_or_else(|| "-".into())),
                    plain(n.reason.map_or("-", Reason::as_str).into()),
                    plain(if gpus.is_empty() {
                        "-".into()
                    } else {
                        gpus.join(",")
                    }),
                    plain(n.action.clone().unwrap_or_else(|| "-".into())),
                    plain(n.fenced.clone().unwrap_or_else(|| "-".into())),
                    plain(n.message.clone().unwrap_or_default()),
                ]
            })
            .collect();
        out.push_str(&table(
            style,
            "  ",
            &[
                "NODE",
                "PHASE",
                "SINCE",
                "POLICY",
                "REASON",
                "BAD GPU INDEXES",
                "ACTION",
                "FENCED",
                "MESSAGE",
            ],
            &rows,
        ));
    }

    if !fleet.bad_gpus.is_empty() {
        out.push('\n');
        out.push_str(&style.bold("Bad GPUs"));
        out.push('\n');
        let rows: Vec<Vec<(String, Paint)>> = fleet
            .bad_gpus
            .iter()
            .map(|g| {
                vec![
                    plain(g.node.clone()),
                    plain(g.index.to_string()),
                    plain(g.uuid.clone()),
                    (format!("{:?}", g.health), health_paint(g.health)),
                    plain(g.fence.clone().unwrap_or_else(|| "-".into())),
                    plain(if g.pods.is_empty() {
                        "none".into()
                    } else {
                        g.pods
                            .iter()
                            .map(ToString::to_string)
                            .collect::<Vec<_>>()
                            .join(", ")
                    }),
                ]
            })
            .collect();
        out.push_str(&table(
            style,
            "  ",
            &["NODE", "GPU", "UUID", "HEALTH", "FENCE", "PODS"],
            &rows,
        ));
    }

    if !fleet.findings.is_empty() {
        out.push('\n');
        out.push_str(&style.bold("Findings"));
        out.push('\n');
        let rows: Vec<Vec<(String, Paint)>> = fleet
            .findings
            .iter()
            .map(|f| {
                vec![
                    plain(f.node.clone()),
                    (f.type_.as_str().to_owned(), Paint::Yellow),
                    plain(
                        f.subject
                            .as_ref()
                            .map_or_else(|| "-".into(), |s| s.to_string()),
                    ),
                    plain(ago(now, f.observed_at.0)),
                    plain(f.message.clone()),
                ]
            })
            .collect();
        out.push_str(&table(
            style,
            "  ",
            &["NODE", "TYPE", "SUBJECT", "AGE", "MESSAGE"],
            &rows,
        ));
    }

    if fleet.not_healthy.is_empty() && fleet.bad_gpus.is_empty() && fleet.findings.is_empty() {
        out.push('\n');
        out.push_str(
            &style.green("Nothing to look at: every node is Healthy, no GPU is bad, no finding."),
        );
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use gpuhealth_api::{
        GpuHealthPolicySpec, GpuNodeHealthSpec, RecoveryAction,
        node_health::{ActionStatus, Finding, GpuStatus},
        policy::{GpuHealthPolicyStatus, Mode},
        quarantine::{FencedGpu, GpuFence, QuarantineStatus},
        vocabulary::{DeviceId, QuarantineWhy},
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};

    use super::*;

    fn t(s: &str) -> Timestamp {
        s.parse().expect("timestamp")
    }

    fn condition(type_: &str, status: &str, message: &str) -> Condition {
        Condition {
            type_: type_.into(),
            status: status.into(),
            message: message.into(),
            reason: "Test".into(),
            last_transition_time: Time(t("2026-05-29T08:00:00Z")),
            observed_generation: None,
        }
    }

    fn policy(name: &str, mode: Mode, status: GpuHealthPolicyStatus) -> GpuHealthPolicy {
        let mut spec = GpuHealthPolicySpec::for_selector(LabelSelector::default());
        spec.mode = mode;
        let mut p = GpuHealthPolicy::new(name, spec);
        p.status = Some(status);
        p
    }

    fn gpu(index: u32, health: GpuHealth, pods: &[&str]) -> GpuStatus {
        GpuStatus {
            index,
            uuid: format!("GPU-0a1b2c3d-0000-4000-8000-00000000000{index}"),
            pci_bus_id: "00000000:E1:00.0".into(),
            health,
            pods: pods.iter().map(|p| p.parse().expect("a pod key")).collect(),
        }
    }

    fn node(name: &str, status: GpuNodeHealthStatus) -> GpuNodeHealth {
        let mut n = GpuNodeHealth::new(name, GpuNodeHealthSpec {});
        n.status = Some(status);
        n
    }

    /// The incident mid-drain on one node, a node that gave up, and a
    /// healthy one with a finding left from its recovery.
    fn fleet() -> Fleet {
        let policies = [
            policy(
                "gpu-default",
                Mode::Enforce,
                GpuHealthPolicyStatus {
                    nodes: 3,
                    healthy: 1,
                    remediating: 1,
                    failed: 1,
                    conditions: vec![
                        condition("Ready", "True", "3 nodes selected"),
                        condition(
                            "CircuitOpen",
                            "True",
                            "2 of 3 nodes unhealthy, over maxUnhealthy 25%",
                        ),
                        condition("Conflict", "False", ""),
                    ],
                    ..Default::default()
                },
            ),
            policy("lab", Mode::DryRun, GpuHealthPolicyStatus::default()),
        ];
        let draining = GpuNodeHealthStatus {
            phase: Phase::Draining,
            policy: Some("gpu-default".into()),
            phase_since: Some(Time(t("2026-05-29T08:16:00Z"))),
            reason: Some(Reason::Draining),
            message: Some("1 to evict, 0 to finish".into()),
            bad_gpus: 1,
            gpus: (0..8)
                .map(|i| {
                    if i == 7 {
                        gpu(7, GpuHealth::ResetRequired, &["ml-serving/vllm-0"])
                    } else {
                        gpu(i, GpuHealth::Healthy, &[])
                    }
                })
                .collect(),
            action: Some(ActionStatus {
                id: "inc-1-reset-1".parse().expect("an id"),
                type_: RecoveryAction::GpuReset,
                attempt: 1,
                gpus: vec![],
                started_at: Time(t("2026-05-29T08:16:00Z")),
                requested_at: None,
                deadline: None,
            }),
            findings: vec![Finding {
                type_: FindingKind::PodOnBadGpu,
                subject: Some("ml-serving/vllm-0".into()),
                message: "pod ml-serving/vllm-0 holds GPU 7".into(),
                observed_at: Time(t("2026-05-29T08:15:45Z")),
            }],
            quarantine: Some(QuarantineStatus {
                incident: "inc-1".into(),
                scope: Fenced::Gpu,
                why: QuarantineWhy::GpusFenced,
                message: "GPU 7 fenced by DeviceTaintRule (NoSchedule)".into(),
                gpus: vec![FencedGpu {
                    uuid: gpu(7, GpuHealth::ResetRequired, &[]).uuid,
                    index: Some(7),
                    fence: GpuFence::DeviceTaintRule,
                    device: Some(DeviceId::new("gpu.nvidia.com", "192.168.1.1", "gpu-7")),
                    rule: Some("gpuhealth-inc-1-gpu-7".into()),
                }],
                since: Time(t("2026-05-29T08:16:00Z")),
                lifted_at: None,
            }),
            ..Default::default()
        };
        let failed = GpuNodeHealthStatus {
            phase: Phase::Failed,
            policy: Some("gpu-default".into()),
            phase_since: Some(Time(t("2026-05-29T06:00:00Z"))),
            reason: Some(Reason::EscalationExhausted),
            message: Some("every rung of the escalation ladder failed".into()),
            gpus: vec![gpu(2, GpuHealth::Lost, &[])],
            ..Default::default()
        };
        let healthy = GpuNodeHealthStatus {
            policy: Some("gpu-default".into()),
            findings: vec![Finding {
                type_: FindingKind::StartupProbeTooShort,
                subject: Some("ReplicaSet/ml-serving/vllm-7d9f6".into()),
                message: "startup window 330s is shorter than its cold start".into(),
                observed_at: Time(t("2026-05-29T08:30:00Z")),
            }],
            ..Default::default()
        };
        let nodes = [
            node("192.168.1.1", draining),
            node("192.168.1.2", healthy),
            node("192.168.1.3", failed),
        ];
        build(&policies, &nodes)
    }

    #[test]
    fn the_fleet_counts_phases_and_puts_the_worst_first() {
        let f = fleet();
        assert_eq!(f.nodes, 3);
        let phases: Vec<(Phase, usize)> = f.phases.iter().map(|c| (c.phase, c.nodes)).collect();
        assert_eq!(
            phases,
            vec![
                (Phase::Healthy, 1),
                (Phase::Draining, 1),
                (Phase::Failed, 1)
            ]
        );
        let order: Vec<&str> = f.not_healthy.iter().map(|n| n.node.as_str()).collect();
        assert_eq!(order, ["192.168.1.3", "192.168.1.1"]);
        assert_eq!(f.not_healthy[1].bad_gpus, vec![7]);
        assert_eq!(f.not_healthy[1].action.as_deref(), Some("GpuReset#1"));
        assert_eq!(f.bad_gpus.len(), 2);
        assert_eq!(
            f.findings[0].type_,
            FindingKind::StartupProbeTooShort,
            "newest first"
        );
        assert!(f.policies[0].circuit_open);
        assert_eq!(f.policies[1].ready, None, "no status written yet");
    }

    #[test]
    fn the_text_names_policies_nodes_gpus_pods_and_findings() {
        let out = text(&fleet(), t("2026-05-29T08:35:00Z"), Style::default());
        for want in [
            "gpu-default  Enforce  3      1        1            1       circuit open",
            "lab          DryRun   0      0        0            0       ok",
            "gpu-default: 2 of 3 nodes unhealthy, over maxUnhealthy 25%",
            "Nodes: 3 (1 Healthy, 1 Draining, 1 Failed)",
            "192.168.1.3  Failed    2h35m ago  gpu-default  EscalationExhausted  2",
            "192.168.1.1  Draining  19m0s ago  gpu-default  Draining             7                GpuReset#1  GPU 7   1 to evict",
            "192.168.1.1  7    GPU-0a1b2c3d-0000-4000-8000-000000000007  ResetRequired  DeviceTaintRule  ml-serving/vllm-0",
            "192.168.1.2  StartupProbeTooShort  ReplicaSet/ml-serving/vllm-7d9f6  5m0s ago",
        ] {
            assert!(out.contains(want), "missing {want:?} in:\n{out}");
        }
        assert!(!out.contains('\x1b'), "no colour when it is off:\n{out}");
    }

    #[test]
    fn an_all_healthy_fleet_says_so_and_colour_marks_phases() {
        let nodes = [node("a", GpuNodeHealthStatus::default())];
        let f = build(&[], &nodes);
        let out = text(&f, t("2026-05-29T08:35:00Z"), Style::default());
        assert!(out.contains("none: no GpuHealthPolicy exists"), "{out}");
        assert!(out.contains("Nodes: 1 (1 Healthy)"), "{out}");
        assert!(out.contains("Nothing to look at"), "{out}");
        let coloured = text(&f, t("2026-05-29T08:35:00Z"), Style { color: true });
        assert!(coloured.contains("\x1b[32mHealthy\x1b[0m"), "{coloured:?}");
    }

    #[test]
    fn findings_an_incident_answered_are_not_open() {
        let mut s = GpuNodeHealthStatus {
            findings: vec![
                Finding {
                    type_: FindingKind::StartupProbeTooShort,
                    subject: Some("StatefulSet/ml/trainer".into()),
                    message: "before the incident".into(),
                    observed_at: Time(t("2026-05-29T07:00:00Z")),
                },
                Finding {
                    type_: FindingKind::PodOnBadGpu,
                    subject: Some("ml/vllm-0".into()),
                    message: "pod ml/vllm-0 holds GPU 7".into(),
                    observed_at: Time(t("2026-05-29T08:15:43Z")),
                },
            ],
            history: vec![gpuhealth_api::node_health::Incident {
                signals: Vec::new(),
                id: "inc-1".into(),
                started_at: Time(t("2026-05-29T08:15:43Z")),
                ended_at: None,
                trigger: "Xid 119".into(),
                attempts: vec![],
                actions: vec![],
                outcome: None,
                gpus: vec![],
                maintenance_deadline: None,
                workloads: None,
                gangs: Vec::new(),
            }],
            bad_gpus: 1,
            ..Default::default()
        };
        let open = |s: &GpuNodeHealthStatus| -> Vec<String> {
            s.open_findings().map(|f| f.message.clone()).collect()
        };
        assert_eq!(open(&s), ["pod ml/vllm-0 holds GPU 7"]);
        // GPU 7 reset: the pod is on a good GPU now.
        s.bad_gpus = 0;
        assert!(open(&s).is_empty());
    }

    #[test]
    fn json_is_camel_case() {
        let v = serde_json::to_value(fleet()).expect("json");
        assert_eq!(v["notHealthy"][0]["badGpus"][0], 2);
        assert_eq!(v["badGpus"][0]["health"], "ResetRequired");
        assert_eq!(v["findings"][0]["observedAt"], "2026-05-29T08:30:00Z");
        assert_eq!(v["policies"][0]["circuitOpen"], true);
    }
}
