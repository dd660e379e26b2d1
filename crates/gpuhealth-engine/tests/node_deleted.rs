//! A Node deleted mid-incident takes its requests with it (the annotations
//! are the Node's). The incident is never silently done: it fails with a
//! finding, an attempt in flight is recorded as abandoned, gpuhealth's
//! device fences come down, and the record stays for a person. A node with
//! nothing under way just goes.

mod common;

use std::time::Duration;

use common::{Agent, World};
use gpuhealth_api::{
    node_health::Phase,
    vocabulary::{Attempt, AttemptAction, AttemptOutcome, FindingKind, IncidentOutcome, Reason},
};
use gpuhealth_engine::{
    happening::Happening,
    machine::{Action, Gone},
};

const HOUR: Duration = Duration::from_secs(3600);

#[test]
fn a_node_deleted_with_a_reset_in_flight_fails_says_so_and_takes_its_fences_down() {
    let mut w = World::incident().with_dra();
    w.reset_agent = Agent::Silent;
    w.run_until(
        |w| w.state.phase == Phase::Remediating && w.node.reset_request.is_some(),
        HOUR,
    );
    let id = w.node.reset_request.clone().expect("the request");
    let rules = w.rules();
    assert_eq!(rules.len(), 1, "the bad GPU is fenced");

    let Gone::Record(decision) = w.node_deleted() else {
        panic!("an incident in flight is recorded");
    };
    assert_eq!(w.state.phase, Phase::Failed);
    assert_eq!(w.state.reason, Some(Reason::NodeDeleted));
    assert_eq!(
        decision.actions,
        [Action::UntaintDevice {
            rule: rules[0].clone()
        }],
        "nothing but the fence coming down: the Node is gone"
    );
    let cancelled = Attempt::new(AttemptAction::GpuReset, 1, AttemptOutcome::Cancelled)
        .saying("the Node was deleted");
    assert!(
        w.state.history[0].attempts.contains(&cancelled),
        "{:?}",
        w.state.history[0].attempts
    );
    assert_eq!(w.state.history[0].outcome, Some(IncidentOutcome::Failed));
    let found: Vec<_> = w
        .state
        .findings
        .iter()
        .filter(|f| f.type_ == FindingKind::NodeDeleted)
        .collect();
    assert_eq!(found.len(), 1, "{:?}", w.state.findings);
    assert!(
        found[0].message.contains(id.as_str()) && found[0].message.contains("abandoned"),
        "{}",
        found[0].message
    );
    assert!(
        w.happenings.iter().any(|h| matches!(
            h,
            Happening::Found {
                kind: FindingKind::NodeDeleted,
                ..
            }
        )),
        "said: {:?}",
        w.happenings
    );

    // The rule is gone: the quarantine is forgotten, and then nothing is
    // left to do; the record stays, Failed.
    assert!(w.rules().is_empty());
    assert!(matches!(w.node_deleted(), Gone::Record(_)));
    assert_eq!(w.state.quarantine, None);
    assert!(matches!(w.node_deleted(), Gone::Kept));
    assert_eq!(w.state.reason, Some(Reason::NodeDeleted));
}

#[test]
fn a_fence_that_did_not_come_down_is_taken_down_again() {
    let mut w = World::incident().with_dra();
    w.reconcile();
    let rules = w.rules();
    assert_eq!(w.state.phase, Phase::Quarantined);
    let rules_before = w.node.dra.clone();
    assert!(matches!(w.node_deleted(), Gone::Record(_)));
    assert_eq!(w.state.reason, Some(Reason::NodeDeleted));
    // The delete failed: the rule is still there on the next look.
    w.node.dra = rules_before;
    let Gone::Record(again) = w.node_deleted() else {
        panic!("a fence still up is taken down");
    };
    assert_eq!(
        again.actions,
        [Action::UntaintDevice {
            rule: rules[0].clone()
        }]
    );
    assert!(
        again.happenings.is_empty(),
        "said once: {:?}",
        again.happenings
    );
}

#[test]
fn a_node_with_nothing_under_way_just_goes() {
    let mut w = World::incident();
    w.clear();
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert!(matches!(w.node_deleted(), Gone::Forget));

    // Handed to a person already: deleting the Node is theirs to do.
    let mut w = World::incident();
    w.reset_agent = Agent::Fails;
    w.reboot_agent = Agent::Fails;
    w.run_until(|w| w.state.phase == Phase::Failed, 10 * HOUR);
    assert_ne!(w.state.reason, Some(Reason::NodeDeleted));
    assert!(matches!(w.node_deleted(), Gone::Forget));
}

#[test]
fn a_node_registered_again_under_the_name_serves_once_healthy() {
    let mut w = World::incident();
    w.reset_agent = Agent::Silent;
    w.run_until(|w| w.state.phase == Phase::Remediating, HOUR);
    assert!(matches!(w.node_deleted(), Gone::Record(_)));

    // A new machine takes the name: not cordoned, its GPUs healthy.
    w.node.unschedulable = false;
    w.node.cordoned_by = None;
    w.node.reset_request = None;
    w.clear();
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert_eq!(
        w.count(|a| matches!(a, Action::Cordon { .. })),
        1,
        "only the first incident's cordon"
    );
}
