//! `verification.stableFor` is never shorter than set, though the status
//! keeps its times to the second and the operator reads it back each step.

mod common;

use std::time::Duration;

use common::World;
use gpuhealth_api::node_health::Phase;
use k8s_openapi::jiff::Timestamp;

#[test]
fn stable_for_is_never_cut_short_by_a_status_kept_to_the_second() {
    let mut w = World::incident();
    // A clock off the whole second, as the operator's is.
    w.advance(Duration::from_millis(700));
    let stable_for = w.spec.verification.stable_for.as_std();
    let mut clear_from: Option<Timestamp> = None;
    for _ in 0..20_000 {
        let before = w.state.clear_since.is_some();
        let at = w.now;
        w.reconcile();
        if let Some(since) = w.state.clear_since.as_ref().map(|t| t.0)
            && !before
        {
            clear_from = Some(at);
            assert!(since >= at, "recorded {since}, clear at {at}");
            assert_eq!(since.subsec_nanosecond(), 0, "{since}");
        }
        if w.state.phase == Phase::Healthy {
            let from = clear_from.expect("clear before healthy");
            let stable = w.now.duration_since(from);
            assert!(
                stable >= stable_for.try_into().expect("a duration"),
                "healthy after {stable} of a stableFor of {stable_for:?}"
            );
            return;
        }
        // What the API server keeps of the status: whole seconds.
        if let Some(t) = &mut w.state.clear_since {
            t.0 = Timestamp::from_second(t.0.as_second()).expect("a time");
        }
        w.advance(Duration::from_millis(300));
        w.agent_turn();
    }
    panic!("never healthy: {:?}", w.state.phase);
}
