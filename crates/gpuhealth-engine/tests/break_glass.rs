//! Break glass: an administrator clears a stuck request by hand, saying why
//! in `gpuhealth.io/break-glass` (admission lets nobody else remove it). The
//! engine abandons the attempt, never re-issues it, leaves the node cordoned
//! to them, and makes the use visible.

mod common;

use std::time::Duration;

use common::{Agent, World};
use gpuhealth_api::node_health::Phase;
use gpuhealth_engine::machine::Action;

const HOUR: Duration = Duration::from_secs(3600);

fn requests(w: &World) -> usize {
    w.count(|a| {
        matches!(
            a,
            Action::RequestReset { .. } | Action::RequestReboot { .. }
        )
    })
}

#[test]
fn a_request_cleared_by_hand_is_abandoned_never_reissued_and_said() {
    let mut w = World::incident();
    w.reset_agent = Agent::Silent;
    w.run_until(
        |w| w.state.phase == Phase::Remediating && w.node.reset_request.is_some(),
        HOUR,
    );
    let id = w.node.reset_request.clone().expect("the request");

    // The on-call engineer removes it, with a reason.
    w.node.reset_request = None;
    w.node.break_glass = Some("agent gone, node to be reimaged".into());
    let actions = w.reconcile();
    assert!(actions.contains(&Action::ClearBreakGlass), "{actions:?}");
    assert_eq!(w.node.break_glass, None);
    assert_eq!(w.state.phase, Phase::Failed);
    assert_eq!(w.state.reason.as_deref(), Some("BreakGlass"));
    let message = w.state.message.clone().unwrap_or_default();
    assert!(
        message.contains(&id) && message.contains("agent gone"),
        "{message}"
    );
    assert!(
        w.state.history[0]
            .actions
            .contains(&"GpuReset#1 Cancelled by hand".to_owned()),
        "{:?}",
        w.state.history[0].actions
    );
    assert_eq!(w.state.history[0].outcome.as_deref(), Some("Failed"));
    let found: Vec<_> = w
        .state
        .findings
        .iter()
        .filter(|f| f.type_ == "BreakGlass")
        .collect();
    assert_eq!(found.len(), 1, "{:?}", w.state.findings);
    assert!(
        found[0].message.contains("never re-issued"),
        "{}",
        found[0].message
    );
    assert!(
        actions
            .iter()
            .any(|a| matches!(a, Action::Event { reason, .. } if reason == "BreakGlass")),
        "an Event: {actions:?}"
    );

    // Left to them: cordoned, and nothing asked again.
    let asked = requests(&w);
    for _ in 0..30 {
        w.advance(Duration::from_secs(10));
        w.reconcile();
    }
    assert_eq!(requests(&w), asked, "never re-issued");
    assert!(w.node.unschedulable, "still cordoned");
    assert_eq!(w.node.reset_request, None);
}

#[test]
fn break_glass_with_nothing_in_flight_is_said_and_changes_nothing_else() {
    let mut w = World::incident();
    w.heal();
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    let before = w.state.phase;
    w.node.break_glass = Some("tidying a leftover cordon record".into());
    let actions = w.reconcile();
    assert!(actions.contains(&Action::ClearBreakGlass), "{actions:?}");
    assert_eq!(w.state.phase, before);
    let found: Vec<_> = w
        .state
        .findings
        .iter()
        .filter(|f| f.type_ == "BreakGlass")
        .collect();
    assert_eq!(found.len(), 1, "{:?}", w.state.findings);
    assert!(
        found[0].message.contains("no request was in flight"),
        "{}",
        found[0].message
    );
}
