//! The workloads around a sick GPU: pods taken out of traffic by their
//! readiness gate, and evicted workloads watched after the node recovers,
//! with the incident's second half (a startup probe shorter than the cold
//! start) told apart from a GPU failure.

mod common;

use std::time::Duration;

use common::World;
use gpuhealth_api::{
    GpuHealth,
    node_health::Phase,
    policy::Mode,
    vocabulary::{FindingKind, PodKey, WorkloadOutcome},
};
use gpuhealth_engine::{
    drain::GpuGate,
    happening::Happening,
    machine::{Action, workloads_to_watch},
    probes::ProbeTiming,
    restarts::{KubeletEvent, Termination},
    workload::{ContainerObservation, PodObservation, WorkloadView},
};
use k8s_openapi::jiff::Timestamp;

const HOUR: Duration = Duration::from_secs(3600);
/// The controller of the pod on GPU 7 (see `common::gpu_pod`).
const VLLM_7: &str = "ReplicaSet/ml-serving/vllm-7-rs";

/// The incident, through to uncordon.
fn recovered_incident() -> World {
    let mut w = World::incident();
    w.spec.verification.workload_recovery_timeout = gpuhealth_api::Duration::from_mins(20);
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    w
}

/// The replacement vLLM pod, started at `started`, Ready or not.
fn replacement(started: Timestamp, ready: bool) -> PodObservation {
    PodObservation {
        pod: PodKey::new("ml-serving", "vllm-7-new"),
        workload: Some(VLLM_7.into()),
        phase: "Running".into(),
        ready,
        ready_since: ready.then(|| {
            started
                .saturating_add(Duration::from_secs(200))
                .expect("time")
        }),
        containers: vec![ContainerObservation {
            name: "vllm".into(),
            startup: Some(ProbeTiming {
                initial_delay_seconds: 30,
                period_seconds: 10,
                timeout_seconds: 5,
                failure_threshold: 30,
            }),
            liveness: None,
            restarts: 0,
            running_since: Some(started),
            waiting: None,
            last: None,
        }],
        events: Vec::new(),
        xids: Vec::new(),
    }
}

/// The replacement killed by its startup probe 331 s into each start.
fn in_a_probe_loop(now: Timestamp) -> PodObservation {
    let killed = now.saturating_sub(Duration::from_secs(5)).expect("time");
    let mut pod = replacement(now, false);
    let c = &mut pod.containers[0];
    c.restarts = 3;
    c.last = Some(Termination {
        reason: "Error".into(),
        exit_code: 137,
        started_at: Some(
            killed
                .saturating_sub(Duration::from_secs(331))
                .expect("time"),
        ),
        finished_at: killed,
    });
    pod.events = vec![
        KubeletEvent {
            reason: "Unhealthy".into(),
            message: "Startup probe failed: Get \"http://10.0.0.7:8000/health\": dial tcp 10.0.0.7:8000: connect: connection refused".into(),
            at: killed,
        },
        KubeletEvent {
            reason: "Killing".into(),
            message: "Container vllm failed startup probe, will be restarted".into(),
            at: killed,
        },
    ];
    pod
}

/// What was said that every evicted workload serves again, in order.
fn said_recovered(w: &World) -> Vec<String> {
    w.said
        .iter()
        .filter_map(|h| match h {
            Happening::WorkloadsRecovered { message } => Some(message.clone()),
            _ => None,
        })
        .collect()
}

/// The findings of `kind` said, in order.
fn said_found(w: &World, kind: FindingKind) -> Vec<String> {
    w.said
        .iter()
        .filter_map(|h| match h {
            Happening::Found {
                kind: k, message, ..
            } if *k == kind => Some(message.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn the_evicted_workload_is_watched_from_uncordon_and_recorded_when_ready_again() {
    let mut w = recovered_incident();
    assert_eq!(workloads_to_watch(&w.state), [VLLM_7]);
    let watch = w.state.history[0].workloads.clone().expect("recorded");
    assert_eq!(watch.evicted, [VLLM_7], "the controller of the evicted pod");
    assert!(watch.deadline.is_some() && watch.outcome.is_none());

    // Rescheduled, still starting: nothing is decided yet.
    w.workloads = vec![WorkloadView {
        name: VLLM_7.into(),
        pods: vec![replacement(w.now, false)],
    }];
    w.reconcile();
    assert_eq!(
        w.state.history[0]
            .workloads
            .as_ref()
            .and_then(|x| x.outcome),
        None
    );

    w.workloads[0].pods = vec![replacement(w.now, true)];
    w.reconcile();
    let watch = w.state.history[0].workloads.clone().expect("recorded");
    assert_eq!(watch.outcome, Some(WorkloadOutcome::Recovered));
    assert!(workloads_to_watch(&w.state).is_empty());
    assert_eq!(said_recovered(&w).len(), 1);
    assert!(
        !w.state
            .findings
            .iter()
            .any(|f| f.type_ == FindingKind::WorkloadNotRecovered),
        "{:?}",
        w.state.findings
    );
}

#[test]
fn a_startup_probe_loop_after_the_reset_is_a_probe_finding_not_a_new_remediation() {
    let mut w = recovered_incident();
    let deadline = w.state.history[0]
        .workloads
        .as_ref()
        .and_then(|x| x.deadline.clone())
        .expect("deadline");
    let log_before = w.log.len();
    while w.now < deadline.0 {
        w.workloads = vec![WorkloadView {
            name: VLLM_7.into(),
            pods: vec![in_a_probe_loop(w.now)],
        }];
        w.reconcile();
        w.advance(Duration::from_secs(10));
    }
    w.reconcile();

    // Never a new signal about the node.
    assert_eq!(w.state.phase, Phase::Healthy);
    assert_eq!(w.state.history.len(), 1, "no second incident");
    assert!(!w.node.unschedulable);
    assert!(
        !w.log[log_before..].iter().any(|a| matches!(
            a,
            Action::Cordon { .. }
                | Action::Evict { .. }
                | Action::RequestReset { .. }
                | Action::RequestReboot { .. }
        )),
        "{:?}",
        &w.log[log_before..]
    );

    let watch = w.state.history[0].workloads.clone().expect("recorded");
    assert_eq!(watch.outcome, Some(WorkloadOutcome::WorkloadNotRecovered));
    let message = watch.message.expect("message");
    assert!(message.contains("killed by its startup probe"), "{message}");
    assert!(message.contains("startup window 330s"), "{message}");

    let probe = w
        .state
        .findings
        .iter()
        .find(|f| f.type_ == FindingKind::StartupProbeTooShort)
        .expect("a probe finding");
    assert_eq!(
        probe.subject,
        Some(gpuhealth_api::vocabulary::FindingSubject::Workload(
            VLLM_7.into()
        ))
    );
    assert!(
        probe
            .message
            .contains("set startupProbe.failureThreshold to"),
        "{}",
        probe.message
    );
    // Said once, on the pod, not every reconcile.
    let on_pod: Vec<_> = w
        .said
        .iter()
        .filter(|h| {
            matches!(h, Happening::Found { kind: FindingKind::StartupProbeTooShort, pod: Some(p), .. }
            if p == "ml-serving/vllm-7-new")
        })
        .collect();
    assert_eq!(on_pod.len(), 1);
    assert!(
        w.state
            .findings
            .iter()
            .any(|f| f.type_ == FindingKind::WorkloadNotRecovered)
    );
    assert_eq!(said_found(&w, FindingKind::WorkloadNotRecovered).len(), 1);
}

#[test]
fn a_workload_that_never_comes_back_is_not_recovered_and_a_zero_timeout_skips_the_check() {
    let mut w = recovered_incident();
    w.advance(Duration::from_secs(21 * 60));
    w.reconcile();
    let watch = w.state.history[0].workloads.clone().expect("recorded");
    assert_eq!(watch.outcome, Some(WorkloadOutcome::WorkloadNotRecovered));
    assert!(watch.message.expect("message").contains("no pods"));

    let mut w = World::incident();
    w.spec.verification.workload_recovery_timeout = gpuhealth_api::Duration::ZERO;
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert!(workloads_to_watch(&w.state).is_empty());
    let watch = w.state.history[0].workloads.clone().expect("recorded");
    assert!(watch.message.expect("message").contains("not checked"));
}

#[test]
fn a_new_incident_supersedes_the_watch() {
    let mut w = recovered_incident();
    w.advance(Duration::from_secs(60));
    w.set_gpu_health(7, GpuHealth::ResetRequired);
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Quarantined);
    let old = w.state.history[1].workloads.clone().expect("recorded");
    assert_eq!(old.outcome, Some(WorkloadOutcome::Superseded));
}

fn gated(w: &mut World, index: usize) {
    w.pods[index].gpu_gate = GpuGate::Is(true);
}

fn gate(w: &World, name: &str) -> GpuGate {
    w.pods
        .iter()
        .find(|p| p.name == name)
        .map_or(GpuGate::NotOptedIn, |p| p.gpu_gate)
}

#[test]
fn a_gated_pod_on_the_bad_gpu_is_taken_out_of_traffic_before_the_drain() {
    let mut w = World::incident();
    gated(&mut w, 7);
    gated(&mut w, 3);
    w.pods[5].gpu_gate = GpuGate::Unset;
    w.reconcile();
    assert_eq!(
        gate(&w, "vllm-7"),
        GpuGate::Is(false),
        "its GPU needs a reset"
    );
    assert_eq!(gate(&w, "vllm-3"), GpuGate::Is(true), "its GPU is fine");
    assert_eq!(gate(&w, "vllm-5"), GpuGate::Is(true), "set for a new pod");
    assert_eq!(
        gate(&w, "vllm-0"),
        GpuGate::NotOptedIn,
        "not opted in: left alone"
    );
    let first = w
        .log
        .iter()
        .position(|a| matches!(a, Action::SetGpuHealthy { healthy: false, .. }));
    let evict = w.log.iter().position(|a| matches!(a, Action::Evict { .. }));
    assert!(first < evict || evict.is_none(), "{:?}", w.log);
}

#[test]
fn the_gate_comes_back_when_the_gpu_does_and_only_enforce_takes_it_away() {
    let mut w = World::incident();
    gated(&mut w, 7);
    // The breaker holds remediation back; the pod is still out of traffic.
    w.spec.max_unhealthy = k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(0);
    w.budget = gpuhealth_engine::budget::Budget::new(&w.spec, 10, 0, 1);
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Suspect);
    assert_eq!(gate(&w, "vllm-7"), GpuGate::Is(false));
    w.set_gpu_health(7, GpuHealth::Healthy);
    w.reconcile();
    assert_eq!(gate(&w, "vllm-7"), GpuGate::Is(true));

    for mode in [Mode::DryRun, Mode::Paused] {
        let mut w = World::incident();
        w.spec.mode = mode;
        gated(&mut w, 7);
        w.pods[7].gpu_gate = GpuGate::Unset;
        w.reconcile();
        assert_eq!(gate(&w, "vllm-7"), GpuGate::Is(true), "{mode:?}");
    }
}
