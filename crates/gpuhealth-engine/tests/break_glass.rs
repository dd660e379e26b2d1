//! Break glass: an administrator clears a stuck request by hand, saying why
//! in `gpuhealth.io/break-glass` (admission lets nobody else remove it). The
//! engine abandons the attempt, never re-issues it, leaves the node cordoned
//! to them, and makes the use visible.

mod common;

use std::time::Duration;

use common::{Agent, World};
use gpuhealth_api::{
    node_health::Phase,
    vocabulary::{Attempt, AttemptAction, AttemptOutcome, FindingKind, IncidentOutcome, Reason},
};
use gpuhealth_engine::{happening::Happening, machine::Action};

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
    assert_eq!(w.state.reason, Some(Reason::BreakGlass));
    let message = w.state.message.clone().unwrap_or_default();
    assert!(
        message.contains(id.as_str()) && message.contains("agent gone"),
        "{message}"
    );
    let cancelled =
        Attempt::new(AttemptAction::GpuReset, 1, AttemptOutcome::Cancelled).saying("by hand");
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
        .filter(|f| f.type_ == FindingKind::BreakGlass)
        .collect();
    assert_eq!(found.len(), 1, "{:?}", w.state.findings);
    assert!(
        found[0].message.contains("never re-issued"),
        "{}",
        found[0].message
    );
    // Said: the finding, and the node's failure for it.
    assert!(
        w.happenings.iter().any(|h| matches!(
            h,
            Happening::Found {
                kind: FindingKind::BreakGlass,
                ..
            }
        )),
        "said: {:?}",
        w.happenings
    );
    assert!(
        w.happenings.iter().any(|h| matches!(
            h,
            Happening::Entered {
                phase: Phase::Failed,
                reason: Reason::BreakGlass,
                ..
            }
        )),
        "said: {:?}",
        w.happenings
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
        .filter(|f| f.type_ == FindingKind::BreakGlass)
        .collect();
    assert_eq!(found.len(), 1, "{:?}", w.state.findings);
    assert!(
        found[0].message.contains("no request was in flight"),
        "{}",
        found[0].message
    );
    assert!(
        w.happenings.iter().any(|h| matches!(
            h,
            Happening::Found {
                kind: FindingKind::BreakGlass,
                ..
            }
        )),
        "said: {:?}",
        w.happenings
    );
}
