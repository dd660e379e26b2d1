//! Without the install's admission protection anyone who may patch Nodes
//! could have written the signal: nothing is enforced. A node with
//! something to act on stays `Suspect`, one mid-way holds where it is, and
//! both go on once protection is back.

mod common;

use std::time::Duration;

use common::{Agent, World};
use gpuhealth_api::{node_health::Phase, vocabulary::Reason};

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
