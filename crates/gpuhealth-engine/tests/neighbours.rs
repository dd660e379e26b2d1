//! gpuhealth among other actors and other times: scheduled maintenance,
//! other tools disrupting nodes, repeat offenders, maintenance windows.

mod common;

use std::time::Duration;

use common::{World, ts};
use gpuhealth_api::{
    GpuHealth,
    contract::{MaintenanceNotice, NEEDS_REPLACEMENT_LABEL},
    node_health::Phase,
    policy::{DrainScope, MaintenanceWindow},
    vocabulary::{FindingKind, IncidentOutcome, Reason},
};
use gpuhealth_engine::{budget::Budget, machine::Action};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};

const HOUR: Duration = Duration::from_secs(3600);

fn notice(deadline: Timestamp) -> MaintenanceNotice {
    MaintenanceNotice {
        deadline: Time(deadline),
        source: "cloud-provider".into(),
        reason: "hardware maintenance: GPU requires reset".into(),
        reference: Some("evt-1234".into()),
    }
}

fn later(w: &World, d: Duration) -> Timestamp {
    w.now.saturating_add(d).expect("time")
}

/// A healthy node (GPU 7 fixed) with maintenance announced `ahead` from now.
fn announced(ahead: Duration) -> World {
    let mut w = World::incident();
    w.clear();
    w.spec.maintenance.lead_time = gpuhealth_api::Duration::from_mins(1);
    // Half a second past: Kubernetes keeps times to the second, and the
    // notice must still be recognised as the one handled.
    w.node.maintenance = Some(Ok(notice(later(&w, ahead + Duration::from_millis(500)))));
    w
}

fn reboot(w: &mut World) {
    w.node.boot_id = "boot-after-maintenance".into();
    w.heal();
}

#[test]
fn a_notice_drains_the_node_ahead_of_its_deadline_and_it_returns_after_the_work() {
    let mut w = announced(Duration::from_secs(120));
    let deadline = later(&w, Duration::from_secs(120));
    w.reconcile();
    assert_eq!(
        w.state.phase,
        Phase::Healthy,
        "not yet: the lead time is 1 minute"
    );
    assert!(!w.node.unschedulable);

    w.run_until(|w| w.state.phase == Phase::AwaitingMaintenance, HOUR);
    assert!(w.now < deadline, "drained before the deadline");
    assert!(w.node.unschedulable);
    assert!(
        w.pods.is_empty(),
        "every pod left: the provider takes the node"
    );
    assert!(
        w.executed.is_empty(),
        "no reset or reboot of gpuhealth's own"
    );

    // Nothing happens until the provider's work shows as a new boot id.
    w.advance(Duration::from_secs(600));
    w.reconcile();
    assert_eq!(w.state.phase, Phase::AwaitingMaintenance);
    reboot(&mut w);
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert!(!w.node.unschedulable, "uncordoned");
    let incident = &w.state.history[0];
    assert_eq!(incident.outcome, Some(IncidentOutcome::Recovered));
    assert_eq!(incident.maintenance_deadline, Some(Time(deadline)));

    // The notice is still on the node: handled once, not again.
    w.advance(HOUR);
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Healthy);
    assert_eq!(w.state.history.len(), 1);
}

#[test]
fn a_provider_that_never_comes_is_reported_overdue_and_a_withdrawn_notice_returns_the_node() {
    let mut w = announced(Duration::from_secs(120));
    w.run_until(|w| w.state.phase == Phase::AwaitingMaintenance, HOUR);
    w.advance(2 * HOUR);
    w.reconcile();
    assert_eq!(
        w.state.phase,
        Phase::AwaitingMaintenance,
        "still waiting, cordoned"
    );
    assert!(
        w.state
            .findings
            .iter()
            .any(|f| f.type_ == FindingKind::MaintenanceOverdue),
        "{:?}",
        w.state.findings
    );
    w.node.maintenance = None;
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Healthy);
    assert!(!w.node.unschedulable);
    assert_eq!(w.state.history[0].outcome, Some(IncidentOutcome::Cancelled));
}

#[test]
fn a_deadline_already_past_is_reported_not_acted_on() {
    let mut w = announced(Duration::from_secs(120));
    w.advance(Duration::from_secs(180));
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Healthy);
    assert!(!w.node.unschedulable);
    assert!(
        w.state
            .findings
            .iter()
            .any(|f| f.type_ == FindingKind::MaintenanceDeadlinePassed),
        "{:?}",
        w.state.findings
    );
}

#[test]
fn a_gpu_failing_before_maintenance_waits_for_it_unless_the_policy_says_remediate() {
    let mut w = World::incident();
    w.node.maintenance = Some(Ok(notice(later(&w, 24 * HOUR))));
    w.run_until(|w| w.state.phase == Phase::AwaitingMaintenance, HOUR);
    assert!(w.executed.is_empty(), "the provider's work is the repair");

    let mut w = World::incident();
    w.spec.maintenance.remediate_before = true;
    w.node.maintenance = Some(Ok(notice(later(&w, 24 * HOUR))));
    w.run_until(
        |w| w.state.phase == Phase::Healthy && !w.executed.is_empty(),
        HOUR,
    );
    assert_eq!(w.executed.len(), 1, "reset first");
}

/// Breaks GPU 7 again and runs the remediation to its end.
fn fail_again(w: &mut World) {
    w.set_gpu_health(7, GpuHealth::ResetRequired);
    w.run_until(
        |w| {
            matches!(w.state.phase, Phase::Healthy | Phase::Failed) && w.state.incident.is_none()
                || w.state.phase == Phase::Failed
        },
        2 * HOUR,
    );
}

#[test]
fn the_third_remediation_of_a_gpu_in_the_window_hands_the_node_over_instead() {
    let mut w = World::incident();
    w.spec.remediation_limits.cooldown = gpuhealth_api::Duration::ZERO;
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    w.advance(HOUR);
    fail_again(&mut w);
    assert_eq!(w.state.phase, Phase::Healthy, "the second is allowed");
    assert_eq!(w.executed.len(), 2);
    w.advance(HOUR);
    fail_again(&mut w);
    assert_eq!(w.state.phase, Phase::Failed);
    assert_eq!(w.state.reason, Some(Reason::RepeatedFailures));
    assert_eq!(w.executed.len(), 2, "no third reset");
    assert!(w.node.unschedulable, "cordoned for the hand-over");
    assert_eq!(
        w.labels.get(NEEDS_REPLACEMENT_LABEL).map(String::as_str),
        Some("true")
    );
    assert!(
        w.state
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("remediated 2 times"),
        "{:?}",
        w.state.message
    );
}

#[test]
fn outside_the_window_the_gpu_count_no_longer_holds() {
    let mut w = World::incident();
    w.spec.remediation_limits.cooldown = gpuhealth_api::Duration::ZERO;
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    w.advance(HOUR);
    fail_again(&mut w);
    w.advance(25 * HOUR);
    fail_again(&mut w);
    assert_eq!(w.state.phase, Phase::Healthy);
    assert_eq!(w.executed.len(), 3);
}

#[test]
fn a_second_remediation_within_the_cooldown_waits_cordoned() {
    let mut w = World::incident();
    w.spec.remediation_limits.cooldown = gpuhealth_api::Duration::from_mins(10);
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    w.advance(Duration::from_secs(60));
    w.set_gpu_health(7, GpuHealth::ResetRequired);
    w.reconcile();
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Quarantined);
    assert_eq!(w.state.reason, Some(Reason::Cooldown));
    assert!(
        w.node.unschedulable,
        "no new pod lands on the bad GPU meanwhile"
    );
    assert_eq!(w.executed.len(), 1);
    w.run_until(|w| w.executed.len() == 2, HOUR);
}

#[test]
fn a_node_another_tool_disrupts_is_left_alone_until_it_is_done() {
    let mut w = World::incident();
    w.node.disrupted_by =
        vec!["gpu-operator: label nvidia.com/gpu-driver-upgrade-state=upgrade-required".into()];
    w.reconcile();
    w.advance(Duration::from_secs(600));
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Suspect);
    assert_eq!(w.state.reason, Some(Reason::DisruptedByOther));
    assert_eq!(w.state.disrupted_by, w.node.disrupted_by);
    assert!(!w.node.unschedulable);
    assert_eq!(w.count(|a| matches!(a, Action::Cordon { .. })), 0);
    w.node.disrupted_by.clear();
    w.run_until(
        |w| w.state.phase == Phase::Healthy && !w.executed.is_empty(),
        HOUR,
    );
}

#[test]
fn nodes_other_tools_disrupt_count_against_max_concurrent() {
    let mut w = World::incident();
    // maxConcurrent 1, and one other node is being upgraded.
    w.budget = Budget::new(&w.spec, 10, 0, 1).with_others(1);
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Suspect);
    assert_eq!(w.state.reason, Some(Reason::WaitingForBudget));
    assert!(
        w.state
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("1 disrupted by other tools"),
        "{:?}",
        w.state.message
    );
}

/// A window that is not open at the scenario's time (08:25 UTC).
fn closed_window() -> MaintenanceWindow {
    MaintenanceWindow {
        days: Vec::new(),
        start: "22:00".into(),
        end: "02:00".into(),
        time_zone: "UTC".into(),
    }
}

#[test]
fn outside_a_window_a_gpu_pods_drain_waits_while_an_affected_pods_reset_goes_ahead() {
    let mut w = World::incident();
    w.spec.drain.scope = DrainScope::GpuPods;
    w.spec.maintenance_windows = vec![closed_window()];
    w.reconcile();
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Quarantined, "cordoned, waiting");
    assert_eq!(w.state.reason, Some(Reason::OutsideMaintenanceWindow));
    assert!(
        w.state
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("22:00"),
        "{:?}",
        w.state.message
    );
    assert!(w.evicted().is_empty(), "no pod on a healthy GPU is touched");
    // At 22:00 the window opens and the drain proceeds.
    w.now = ts("2026-05-29T22:00:05Z");
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert_eq!(w.evicted().len(), 8);

    let mut w = World::incident();
    w.spec.maintenance_windows = vec![closed_window()];
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert_eq!(w.evicted(), ["ml-serving/vllm-7"], "its own scope, at once");
}
