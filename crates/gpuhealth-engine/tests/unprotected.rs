//! Without the install's admission protection anyone who may patch Nodes
//! could have written the signal: nothing is enforced. A node with
//! something to act on stays `Suspect`, one mid-way holds where it is, and
//! both go on once protection is back. A record of ours on a cordon is
//! not trusted either.

mod common;

use std::time::Duration;

use common::{Agent, World};
use gpuhealth_api::{node_health::Phase, vocabulary::Reason};
use gpuhealth_engine::machine::Action;

const HOUR: Duration = Duration::from_secs(3600);
const WHY: &str = "no admission policy bound to deny guards agent-keys";

#[test]
fn a_signal_is_not_acted_on_until_protection_is_back() {
    let mut w = World::incident();
    w.unprotected = Some(WHY.into());
    for _ in 0..3 {
        let actions = w.reconcile();
        assert!(actions.is_empty(), "nothing enforced: {actions:?}");
        w.advance(Duration::from_secs(60));
    }
    assert_eq!(w.state.phase, Phase::Suspect);
    assert_eq!(w.state.reason, Some(Reason::Unprotected));
    let message = w.state.message.clone().unwrap_or_default();
    assert!(message.starts_with(WHY), "{message}");

    w.unprotected = None;
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert_eq!(w.reset_requests().len(), 1, "acted on once protected");
}

#[test]
fn a_remediation_under_way_holds_where_it_is() {
    let mut w = World::incident();
    w.reset_agent = Agent::Silent;
    w.run_until(|w| w.state.phase == Phase::Remediating, HOUR);
    let requests = w.reset_requests().len();
    w.unprotected = Some(WHY.into());
    w.reset_agent = Agent::Succeeds;
    for _ in 0..3 {
        let actions = w.reconcile();
        assert!(actions.is_empty(), "nothing enforced: {actions:?}");
        w.advance(Duration::from_secs(60));
    }
    assert_eq!(w.state.phase, Phase::Remediating, "held where it was");
    assert_eq!(w.state.reason, Some(Reason::Unprotected));

    w.unprotected = None;
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert_eq!(
        w.reset_requests().len(),
        requests,
        "the same request, not a second"
    );
}

#[test]
fn a_leftover_cordon_is_lifted_only_once_protection_is_back() {
    // The recovery's uncordon did not land. The incident's id is in its
    // status for anyone to copy onto a cordon of theirs: unprotected, a
    // cordon naming it is not lifted as ours.
    let mut w = World::incident();
    w.refused_uncordons = 1;
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    let ours = w.state.history[0].id.clone();
    assert!(w.node.unschedulable, "the first uncordon was refused");
    assert_eq!(w.node.cordoned_by.as_ref(), Some(&ours));

    w.unprotected = Some(WHY.into());
    for _ in 0..3 {
        let actions = w.reconcile();
        assert!(actions.is_empty(), "nothing enforced: {actions:?}");
        w.advance(Duration::from_secs(60));
    }
    assert!(w.node.unschedulable, "left as it is");

    w.unprotected = None;
    let actions = w.reconcile();
    assert!(
        actions
            .iter()
            .any(|a| matches!(a, Action::Uncordon { incident } if *incident == ours)),
        "{actions:?}"
    );
    assert!(!w.node.unschedulable);
    assert_eq!(w.state.phase, Phase::Healthy);
}
