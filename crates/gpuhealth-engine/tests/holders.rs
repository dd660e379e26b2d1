//! Holders are a watched set, not a snapshot: a pod that comes to hold a
//! GPU of the action after its drain (a claim allocated before the fence
//! was up, or while a rule someone deleted was written again) is drained
//! under the same rules, and no request is written while one holds it.

mod common;

use std::time::Duration;

use common::{Agent, BAD_GPU, World, gpu_pod};
use gpuhealth_api::{contract::DisruptionTolerance, node_health::Phase, vocabulary::Reason};
use gpuhealth_engine::machine::{Action, validation_pod_name};

const HOUR: Duration = Duration::from_secs(3600);

fn requests(actions: &[Action]) -> usize {
    actions
        .iter()
        .filter(|a| matches!(a, Action::RequestReset { .. }))
        .count()
}

/// The incident's reset in flight, its agent silent, and its request gone
/// from the node (an operator that crashed between recording it and
/// writing it): the next step would write it again.
fn reset_in_flight_and_lost() -> World {
    let mut w = World::incident();
    w.reset_agent = Agent::Silent;
    w.run_until(|w| w.state.phase == Phase::Remediating, HOUR);
    w.node.reset_request = None;
    w.advance(Duration::from_secs(10));
    w
}

#[test]
fn a_pod_that_came_after_the_drain_leaves_before_the_request_is_written_again() {
    let mut w = reset_in_flight_and_lost();
    w.pods.push(gpu_pod("late", BAD_GPU));
    let actions = w.reconcile();
    assert!(
        actions.contains(&Action::Evict {
            pod: gpuhealth_api::vocabulary::PodKey::new("ml-serving", "late")
        }),
        "{actions:?}"
    );
    assert_eq!(requests(&actions), 0, "not written while it holds the GPU");
    assert_eq!(w.state.phase, Phase::Remediating);
    assert_eq!(w.state.reason, Some(Reason::HolderArrived));
    let message = w.state.message.clone().unwrap_or_default();
    assert!(message.contains("ml-serving/late (evicted)"), "{message}");

    // Gone (the world carried the eviction out): the request again, the
    // same one, and the status as it was.
    w.advance(Duration::from_secs(5));
    let actions = w.reconcile();
    assert_eq!(requests(&actions), 1, "{actions:?}");
    assert_eq!(w.state.reason, Some(Reason::ActionRequested));
    assert_eq!(w.reset_requests().len(), 2, "the first and the same again");
}

#[test]
fn a_never_pod_that_came_after_the_drain_holds_the_request_and_is_named() {
    let mut w = reset_in_flight_and_lost();
    let mut late = gpu_pod("late", BAD_GPU);
    late.tolerance = Ok(DisruptionTolerance::Never);
    w.pods.push(late);
    for _ in 0..5 {
        let actions = w.reconcile();
        assert_eq!(requests(&actions), 0, "{actions:?}");
        assert!(
            !actions
                .iter()
                .any(|a| matches!(a, Action::Evict { .. } | Action::ForceDelete { .. })),
            "{actions:?}"
        );
        w.advance(Duration::from_secs(5));
    }
    assert_eq!(w.state.reason, Some(Reason::HolderArrived));
    let message = w.state.message.clone().unwrap_or_default();
    assert!(
        message.contains("ml-serving/late (its disruption tolerance is `never`)"),
        "{message}"
    );
}

#[test]
fn a_pod_on_the_gpu_while_it_is_verified_leaves_but_its_validation_pod_stays() {
    let mut w = World::incident();
    w.run_until(|w| w.state.phase == Phase::Verifying, HOUR);
    let id = w.state.action.clone().expect("the attempt").id;
    let mut validation = gpu_pod(&validation_pod_name(&w.node.name, &id), BAD_GPU);
    validation.namespace = "gpuhealth-validation".into();
    w.pods.push(validation);
    w.pods.push(gpu_pod("late", BAD_GPU));
    w.reconcile();
    assert_eq!(
        w.evicted().last().map(String::as_str),
        Some("ml-serving/late")
    );
    assert!(
        !w.evicted()
            .iter()
            .any(|p| p.starts_with("gpuhealth-validation/")),
        "{:?}",
        w.evicted()
    );
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
}

#[test]
fn a_pod_on_another_gpu_is_no_holder() {
    let mut w = reset_in_flight_and_lost();
    w.pods.push(gpu_pod(
        "elsewhere",
        "GPU-0a1b2c3d-0000-4000-8000-000000000003",
    ));
    let actions = w.reconcile();
    assert_eq!(requests(&actions), 1, "{actions:?}");
    assert!(
        !w.evicted().contains(&"ml-serving/elsewhere".to_owned()),
        "{:?}",
        w.evicted()
    );
}

#[test]
fn the_reset_waits_until_its_rule_has_stood_long_enough_for_a_late_allocation_to_be_seen() {
    // GPU 7 held by nobody: its drain ends at once. A scheduler that had
    // not yet seen the rule may still give the device out a moment after
    // it is written; the reset waits until the rule has stood
    // FENCE_SETTLE, and a pod given it meanwhile is drained first.
    let mut w = World::incident().with_dra();
    w.pods.retain(|p| !p.gpus.iter().any(|g| g == BAD_GPU));
    for _ in 0..3 {
        let actions = w.reconcile();
        assert_eq!(requests(&actions), 0, "{actions:?}");
    }
    assert_eq!(w.state.phase, Phase::Draining);
    let message = w.state.message.clone().unwrap_or_default();
    assert!(message.contains("have stood 2 s"), "{message}");
    w.pods.push(gpu_pod("late", BAD_GPU));
    w.advance(gpuhealth_engine::machine::FENCE_SETTLE);
    let actions = w.reconcile();
    assert_eq!(requests(&actions), 0, "{actions:?}");
    assert_eq!(w.evicted(), ["ml-serving/late"]);
    w.run_until(|w| w.state.phase == Phase::Remediating, HOUR);
    assert_eq!(w.reset_requests().len(), 1);

    // A rule written again (someone deleted it) settles again.
    let mut w = World::incident().with_dra();
    w.pods.retain(|p| !p.gpus.iter().any(|g| g == BAD_GPU));
    w.reconcile();
    w.advance(Duration::from_secs(1));
    w.node.dra.as_mut().expect("dra").rules.clear();
    let actions = w.reconcile();
    assert!(
        actions
            .iter()
            .any(|a| matches!(a, Action::TaintDevice { .. })),
        "written again: {actions:?}"
    );
    w.advance(Duration::from_millis(1500));
    for _ in 0..2 {
        assert_eq!(requests(&w.reconcile()), 0, "the new rule has not settled");
    }
    w.advance(Duration::from_secs(1));
    w.reconcile();
    assert_eq!(w.reset_requests().len(), 1, "asked for once it has");
}
