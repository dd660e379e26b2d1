//! A tenant's faults are the tenant's: application Xids from one pod are a
//! finding on that pod, never an action on the GPU and never a count
//! against the node; an incident they open across workloads never hands
//! the node over for replacement. And an Xid NVML did not confirm is said,
//! never acted on.

mod common;

use std::time::Duration;

use common::{Agent, BAD_GPU, World};
use gpuhealth_api::{
    RecoveryAction,
    contract::{NEEDS_REPLACEMENT_LABEL, PodRef, REPLACE_LABEL, XidEvent},
    node_health::Phase,
    policy::EscalationStep,
    vocabulary::{FindingKind, FindingSubject, PodKey, Reason},
};
use gpuhealth_engine::{happening::Happening, machine::Action};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

const HOUR: Duration = Duration::from_secs(3600);

/// The incident's node with every GPU healthy, no Xid and no row remap,
/// GPU 7 held by pod `vllm-7`.
fn quiet() -> World {
    let mut w = World::incident();
    w.clear();
    if let Some(Ok(report)) = &mut w.node.report {
        report.gpus.iter_mut().for_each(|g| g.remapped_rows = None);
    }
    w
}

/// An application Xid (13) on GPU 7 now, blamed on `pod` (the agent names
/// the pod that alone held the GPU).
fn fault(w: &mut World, pod: Option<&str>) {
    let at = Time(w.agent_now());
    if let Some(Ok(report)) = &mut w.node.report {
        report.observed_at = at.clone();
        let gpu = report
            .gpus
            .iter_mut()
            .find(|g| g.uuid == BAD_GPU)
            .expect("GPU 7");
        gpu.xids.push(XidEvent {
            pid: Some(4242),
            process: Some("python3".into()),
            pod: pod.map(|name| PodRef {
                namespace: "ml-serving".into(),
                name: name.into(),
                container: Some("vllm".into()),
            }),
            ..XidEvent::new(13, at, "Graphics Exception")
        });
    }
}

#[test]
fn one_pods_repeated_faults_are_a_finding_on_it_and_nothing_more() {
    let mut w = quiet();
    for _ in 0..5 {
        fault(&mut w, Some("vllm-7"));
        w.reconcile();
        w.advance(Duration::from_secs(60));
    }
    assert_eq!(w.state.phase, Phase::Healthy, "{:?}", w.state.history);
    assert!(
        w.state.history.is_empty(),
        "no incident: {:?}",
        w.state.history
    );
    assert!(w.log.is_empty(), "nothing done: {:?}", w.log);
    let pod = PodKey::new("ml-serving", "vllm-7");
    let finding = w
        .state
        .findings
        .iter()
        .find(|f| f.type_ == FindingKind::AppFaultLoop)
        .expect("a finding");
    assert_eq!(finding.subject, Some(FindingSubject::Pod(pod.clone())));
    assert!(finding.message.contains("5 times"), "{}", finding.message);
    // Said on the pod, as a Warning Event, from the third fault on.
    let told: Vec<&Happening> = w
        .said
        .iter()
        .filter(|h| matches!(h, Happening::Found { kind: FindingKind::AppFaultLoop, pod: Some(p), .. } if *p == pod))
        .collect();
    assert_eq!(told.len(), 3, "{told:?}");
}

#[test]
fn faults_from_two_workloads_reset_the_gpu() {
    let mut w = quiet();
    fault(&mut w, Some("vllm-7"));
    fault(&mut w, Some("vllm-7"));
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Healthy);
    fault(&mut w, Some("batch-job-1"));
    w.run_until(|w| !w.executed.is_empty(), HOUR);
    assert_eq!(w.reset_requests(), [vec![BAD_GPU.to_owned()]]);
    let incident = w.state.history.first().expect("an incident");
    assert!(incident.opened_by_app_faults_alone());
    assert_eq!(incident.signals[0].reason, Reason::RepeatedAppXids);
}

#[test]
fn app_fault_incidents_are_not_counted_and_never_hand_the_node_over() {
    let mut w = quiet();
    w.spec.remediation_limits.cooldown = gpuhealth_api::Duration::ZERO;
    // Three incidents of app faults from two workloads, an hour apart: a
    // third remediation of one GPU in the window would hand the node over
    // (remediationLimits.perGpu 2), were they counted.
    for round in 0..3 {
        fault(&mut w, Some("vllm-7"));
        fault(&mut w, Some("vllm-7"));
        fault(&mut w, Some(&format!("batch-{round}")));
        w.run_until(
            |w| w.state.phase == Phase::Healthy && w.executed.len() == round + 1,
            HOUR,
        );
        w.clear();
        w.advance(HOUR);
    }
    assert_eq!(w.executed.len(), 3, "each reset carried out");
    assert!(
        !w.labels.contains_key(NEEDS_REPLACEMENT_LABEL),
        "{:?}",
        w.labels
    );

    // And when every rung below replacement fails, the node stays
    // cordoned for a person, not labelled for replacement.
    w.spec.escalation.push(EscalationStep {
        action: RecoveryAction::ReplaceNode,
        attempts: 1,
        timeout: None,
    });
    w.reset_agent = Agent::Fails;
    w.reboot_agent = Agent::Fails;
    fault(&mut w, Some("vllm-7"));
    fault(&mut w, Some("vllm-7"));
    fault(&mut w, Some("batch-9"));
    w.run_until(|w| w.state.phase == Phase::Failed, 6 * HOUR);
    assert_eq!(w.state.reason, Some(Reason::EscalationExhausted));
    assert!(w.node.unschedulable, "cordoned for a person");
    assert!(!w.labels.contains_key(REPLACE_LABEL), "{:?}", w.labels);
    assert!(
        !w.labels.contains_key(NEEDS_REPLACEMENT_LABEL),
        "{:?}",
        w.labels
    );
    assert!(
        w.state
            .message
            .as_deref()
            .is_some_and(|m| m.contains("not handed over for replacement")),
        "{:?}",
        w.state.message
    );
}

#[test]
fn an_xid_nvml_did_not_confirm_is_a_finding_not_an_action() {
    let mut w = quiet();
    let at = Time(w.agent_now());
    if let Some(Ok(report)) = &mut w.node.report {
        report.gpus[3].xids.push(XidEvent {
            uncorroborated: true,
            ..XidEvent::new(79, at, "GPU has fallen off the bus.")
        });
    }
    for _ in 0..3 {
        w.reconcile();
        w.advance(Duration::from_secs(60));
    }
    assert_eq!(w.state.phase, Phase::Healthy);
    assert!(
        w.log.iter().all(|a| !matches!(a, Action::Cordon { .. })),
        "{:?}",
        w.log
    );
    let found: Vec<_> = w
        .state
        .findings
        .iter()
        .filter(|f| f.type_ == FindingKind::UncorroboratedXid)
        .collect();
    assert_eq!(found.len(), 1, "{:?}", w.state.findings);
    assert!(found[0].message.contains("Xid 79"), "{}", found[0].message);
    let told = w
        .said
        .iter()
        .filter(|h| {
            matches!(
                h,
                Happening::Found {
                    kind: FindingKind::UncorroboratedXid,
                    ..
                }
            )
        })
        .count();
    assert_eq!(told, 1, "said once");
}
