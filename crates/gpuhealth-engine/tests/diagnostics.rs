//! `verification.diagnostics`: DCGM's diagnostic on the repaired GPUs
//! before they serve again. A pass (or a warning) goes on; a failure, a
//! diagnostic that times out and one never answered are failed attempts,
//! never an uncordon; one that cannot run holds the node for a person.

mod common;

use std::time::Duration;

use common::{BAD_GPU, World};
use gpuhealth_api::{
    contract::{DiagnosticsLevel, DiagnosticsVerdict, RequestId, TestVerdict},
    node_health::Phase,
    types::RecoveryAction,
    vocabulary::{Attempt, AttemptAction, AttemptOutcome, IncidentOutcome, Reason},
};
use gpuhealth_engine::machine::Action;

const HOUR: Duration = Duration::from_secs(3600);

fn with_diagnostics(level: DiagnosticsLevel) -> World {
    let mut w = World::incident();
    w.spec.verification.diagnostics.level = level;
    w.spec.verification.diagnostics.timeout = gpuhealth_api::Duration::from_mins(5);
    w
}

/// The open or last incident's attempts, as (action, attempt, outcome).
fn attempts(w: &World) -> Vec<(AttemptAction, u32, AttemptOutcome)> {
    w.state.history[0]
        .attempts
        .iter()
        .map(|a| (a.action, a.attempt, a.outcome))
        .collect()
}

fn diagnostics_attempt(w: &World) -> &Attempt {
    w.state.history[0]
        .attempts
        .iter()
        .find(|a| a.action == AttemptAction::Diagnostics)
        .expect("a diagnostic on the record")
}

/// The reboot rung in flight: the attempt before it failed.
fn rebooting(w: &World) -> bool {
    w.state
        .action
        .as_ref()
        .is_some_and(|a| a.type_ == RecoveryAction::NodeReboot)
}

fn uncordons(w: &World) -> usize {
    w.count(|a| matches!(a, Action::Uncordon { .. }))
}

#[test]
fn off_asks_for_no_diagnostic() {
    let mut w = World::incident();
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert_eq!(
        w.count(|a| matches!(a, Action::RequestDiagnostics { .. })),
        0
    );
}

#[test]
fn a_passed_diagnostic_after_stable_for_returns_the_gpu() {
    let mut w = with_diagnostics(DiagnosticsLevel::Quick);
    w.run_until(|w| w.state.reason == Some(Reason::Diagnosing), HOUR);
    // Asked once signals have stayed clear for stableFor, of the reset GPU.
    let asked = w.diagnostics_asked.clone().expect("asked");
    assert_eq!(asked.gpus, [BAD_GPU]);
    assert_eq!(asked.level, DiagnosticsLevel::Quick);
    let action = w.state.action.clone().expect("the reset in verification");
    assert_eq!(asked.id, RequestId::for_diagnostics(&action.id));
    let since = w.state.clear_since.clone().expect("clear").0;
    assert!(
        asked.requested_at.0
            >= since
                .checked_add(w.spec.verification.stable_for.as_std())
                .expect("time"),
        "asked at {} before stableFor from {since}",
        asked.requested_at.0
    );
    assert!(w.node.unschedulable, "still cordoned while diagnosed");
    assert_eq!(uncordons(&w), 0);

    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert!(!w.node.unschedulable, "uncordoned after the pass");
    assert_eq!(
        attempts(&w),
        [
            (AttemptAction::GpuReset, 1, AttemptOutcome::Succeeded),
            (AttemptAction::Diagnostics, 1, AttemptOutcome::Succeeded),
        ]
    );
    let result = diagnostics_attempt(&w)
        .diagnostics
        .clone()
        .expect("each test's verdict kept");
    assert_eq!(result.verdict, DiagnosticsVerdict::Pass);
    assert_eq!(result.tests[0].gpu.as_deref(), Some(BAD_GPU));
    assert_eq!(result.tests[0].verdict, TestVerdict::Pass);
    assert_eq!(w.state.history[0].outcome, Some(IncidentOutcome::Recovered));
}

#[test]
fn a_warning_returns_the_gpu_and_is_kept() {
    let mut w = with_diagnostics(DiagnosticsLevel::Medium);
    w.diagnostics_verdict = Some(DiagnosticsVerdict::Warn);
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    let attempt = diagnostics_attempt(&w);
    assert_eq!(attempt.outcome, AttemptOutcome::Succeeded);
    let result = attempt.diagnostics.clone().expect("verdicts");
    assert_eq!(result.level, DiagnosticsLevel::Medium);
    assert_eq!(result.verdict, DiagnosticsVerdict::Warn);
    assert!(
        attempt
            .message
            .as_deref()
            .is_some_and(|m| m.contains("Warn")),
        "{attempt:?}"
    );
}

#[test]
fn a_failed_diagnostic_is_a_failed_attempt_never_an_uncordon() {
    let mut w = with_diagnostics(DiagnosticsLevel::Quick);
    w.diagnostics_verdict = Some(DiagnosticsVerdict::Fail);
    w.run_until(rebooting, HOUR);
    assert_eq!(uncordons(&w), 0, "never uncordoned on a failure");
    assert!(w.node.unschedulable);
    assert_eq!(
        attempts(&w),
        [
            (AttemptAction::GpuReset, 1, AttemptOutcome::Succeeded),
            (AttemptAction::Diagnostics, 1, AttemptOutcome::Failed),
        ]
    );
    let result = diagnostics_attempt(&w)
        .diagnostics
        .clone()
        .expect("verdicts");
    assert_eq!(result.tests[0].verdict, TestVerdict::Fail);
    // The next rung is diagnosed afresh, and its pass returns the node.
    w.diagnostics_verdict = Some(DiagnosticsVerdict::Pass);
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert_eq!(
        attempts(&w),
        [
            (AttemptAction::GpuReset, 1, AttemptOutcome::Succeeded),
            (AttemptAction::Diagnostics, 1, AttemptOutcome::Failed),
            (AttemptAction::NodeReboot, 1, AttemptOutcome::Succeeded),
            (AttemptAction::Diagnostics, 1, AttemptOutcome::Succeeded),
        ]
    );
    assert_eq!(uncordons(&w), 1);
}

#[test]
fn a_diagnostic_that_times_out_or_is_never_answered_fails_the_attempt() {
    for verdict in [Some(DiagnosticsVerdict::TimedOut), None] {
        let mut w = with_diagnostics(DiagnosticsLevel::Quick);
        w.diagnostics_verdict = verdict;
        w.run_until(rebooting, HOUR);
        assert_eq!(uncordons(&w), 0, "{verdict:?}");
        assert_eq!(
            attempts(&w)[1],
            (AttemptAction::Diagnostics, 1, AttemptOutcome::TimedOut),
            "{verdict:?}"
        );
    }
}

#[test]
fn the_diagnostic_comes_before_the_validation_pod_and_is_recorded_once() {
    let mut w = with_diagnostics(DiagnosticsLevel::Quick);
    w.spec.verification.validation_pod = Some(gpuhealth_api::policy::ValidationPod {
        template: serde_json::json!({"spec": {"containers": [{"name": "t", "image": "cuda"}]}}),
        timeout: gpuhealth_api::Duration::from_mins(5),
    });
    w.run_until(|w| w.state.reason == Some(Reason::Diagnosing), HOUR);
    assert!(
        w.validation.is_none(),
        "no validation pod before the diagnostic"
    );
    w.run_until(|w| w.state.reason == Some(Reason::Validating), HOUR);
    for _ in 0..5 {
        w.advance(Duration::from_secs(10));
        w.reconcile();
    }
    w.validation.as_mut().expect("created").phase = "Succeeded".into();
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert_eq!(
        attempts(&w),
        [
            (AttemptAction::GpuReset, 1, AttemptOutcome::Succeeded),
            (AttemptAction::Diagnostics, 1, AttemptOutcome::Succeeded),
            (AttemptAction::ValidationPod, 1, AttemptOutcome::Succeeded),
        ]
    );
}

#[test]
fn a_diagnostic_that_cannot_run_holds_the_node_for_a_person_without_a_reboot() {
    let mut w = with_diagnostics(DiagnosticsLevel::Quick);
    w.diagnostics_verdict = Some(DiagnosticsVerdict::Error);
    w.run_until(|w| w.state.phase == Phase::Failed, HOUR);
    assert_eq!(w.state.reason, Some(Reason::DiagnosticsUnavailable));
    assert_eq!(
        attempts(&w),
        [
            (AttemptAction::GpuReset, 1, AttemptOutcome::Succeeded),
            (AttemptAction::Diagnostics, 1, AttemptOutcome::Failed),
        ]
    );
    assert_eq!(
        w.count(|a| matches!(a, Action::RequestReboot { .. })),
        0,
        "no reboot for a dcgmi that is missing"
    );
    assert_eq!(uncordons(&w), 0);
    assert!(w.node.unschedulable);
    let message = w.state.message.clone().unwrap_or_default();
    assert!(message.contains("--dcgmi"), "{message}");
}
