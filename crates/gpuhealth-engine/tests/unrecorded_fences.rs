//! One write to fence: the operator writes an incident's fence (the cordon
//! with the record naming the incident, or a GPU's `DeviceTaintRule`
//! labelled with it) before the status that opens the incident. An
//! operator stopped between the two leaves the fence as the only record;
//! the next step carries that incident on under its id, and never takes
//! anyone else's cordon, or an ended incident's, for one.

mod common;

use std::time::Duration;

use common::World;
use gpuhealth_api::{
    node_health::Phase,
    vocabulary::{IncidentOutcome, Reason},
};
use gpuhealth_engine::{budget::Budget, fence::RuleView, machine::Action};

const HOUR: Duration = Duration::from_secs(3600);
/// The id an operator stopped after the cordon wrote in its record.
const UNRECORDED: &str = "inc-1780042500-9a371f29eed4";

/// The incident's node as a restarted operator finds it: cordoned by
/// gpuhealth for `UNRECORDED`, its status never written.
fn cordoned_unrecorded() -> World {
    let mut w = World::incident();
    w.node.unschedulable = true;
    w.node.cordoned_by = Some(UNRECORDED.into());
    w
}

fn fences(actions: &[Action]) -> Vec<&Action> {
    actions
        .iter()
        .filter(|a| {
            matches!(
                a,
                Action::Cordon { .. }
                    | Action::TaintDevice { .. }
                    | Action::UntaintDevice { .. }
                    | Action::Uncordon { .. }
            )
        })
        .collect()
}

#[test]
fn a_cordon_whose_status_never_landed_is_carried_on_as_its_incident() {
    let mut w = cordoned_unrecorded();
    let actions = w.reconcile();
    assert_eq!(w.state.phase, Phase::Quarantined);
    assert_eq!(w.state.incident.as_deref(), Some(UNRECORDED));
    assert_eq!(w.state.history[0].id, UNRECORDED);
    assert!(fences(&actions).is_empty(), "already fenced: {actions:?}");
    let message = w.state.message.clone().unwrap_or_default();
    assert!(
        message.starts_with("cordoned for:"),
        "ours, lifted at recovery: {message}"
    );

    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert_eq!(w.state.history[0].outcome, Some(IncidentOutcome::Recovered));
    assert!(!w.node.unschedulable, "the cordon it adopted is lifted");
    assert_eq!(w.reset_requests().len(), 1);
}

#[test]
fn it_is_carried_on_even_where_a_new_start_would_wait_for_the_budget() {
    let mut w = cordoned_unrecorded();
    // The other nodes' starts fill the budget now; this node's was counted
    // when its cordon was made.
    w.budget = Budget::new(&w.spec, 10, 1, 1);
    assert!(w.budget.may_start().is_err(), "{:?}", w.budget);
    w.reconcile();
    assert_eq!(w.state.incident.as_deref(), Some(UNRECORDED));
    assert_eq!(w.state.phase, Phase::Quarantined);
}

#[test]
fn a_cordon_whose_fault_has_cleared_is_lifted() {
    let mut w = cordoned_unrecorded();
    w.clear();
    let actions = w.reconcile();
    assert_eq!(
        fences(&actions),
        [&Action::Uncordon {
            incident: UNRECORDED.into()
        }]
    );
    assert_eq!(w.state.phase, Phase::Healthy);
    assert!(!w.node.unschedulable);
}

#[test]
fn someone_elses_cordon_is_never_taken_for_an_unrecorded_one() {
    let mut w = World::incident();
    w.node.unschedulable = true;
    let actions = w.reconcile();
    assert_ne!(w.state.incident.as_deref(), Some(UNRECORDED));
    assert!(fences(&actions).is_empty(), "{actions:?}");
    let message = w.state.message.clone().unwrap_or_default();
    assert!(
        message.starts_with("kept the cordon someone else made"),
        "{message}"
    );
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert!(w.node.unschedulable, "a person's cordon stays");
}

#[test]
fn a_cordon_of_an_incident_already_ended_is_never_reopened() {
    // Recovered, and the uncordon did not land: the record names the
    // last incident, which the history holds.
    let mut w = World::incident();
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    let ended = w.state.history[0].id.clone();
    w.node.unschedulable = true;
    w.node.cordoned_by = Some(ended.clone());
    let actions = w.reconcile();
    assert_eq!(fences(&actions), [&Action::Uncordon { incident: ended }]);
    assert_eq!(w.state.incident, None);
    assert_eq!(w.state.history.len(), 1, "no incident reopened");
}

#[test]
fn a_gpu_fence_whose_status_never_landed_is_carried_on_as_its_incident() {
    let mut w = World::incident().with_dra();
    // What the first step decides: the incident's rule for GPU 7.
    let mut first = World::incident().with_dra();
    let decided = first.reconcile();
    let Some(Action::TaintDevice { rule, incident, .. }) = decided.first().cloned() else {
        panic!("the fence first: {decided:?}");
    };
    // Written, and the operator stopped before the status.
    w.node.dra.as_mut().expect("dra").rules.push(RuleView {
        name: rule.clone(),
        incident: incident.clone(),
        created: None,
    });
    w.advance(Duration::from_secs(30));
    let actions = w.reconcile();
    assert_eq!(w.state.incident.as_deref(), Some(incident.as_str()));
    assert!(
        fences(&actions).is_empty(),
        "the rule is the incident's: {actions:?}"
    );
    assert_eq!(w.state.reason, Some(Reason::Xid), "{:?}", w.state.message);
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert!(w.rules().is_empty(), "lifted at recovery");
}

#[test]
fn while_the_admission_protection_is_not_in_force_a_record_is_not_trusted() {
    // Whoever may patch Nodes could have written the record: a cordon of
    // theirs is neither lifted nor taken for an incident of ours.
    let mut w = cordoned_unrecorded();
    w.unprotected = Some("the admission policies are not bound".into());
    w.clear();
    let actions = w.reconcile();
    assert!(fences(&actions).is_empty(), "{actions:?}");
    assert!(w.node.unschedulable, "left as it is");

    let mut w = cordoned_unrecorded();
    w.unprotected = Some("the admission policies are not bound".into());
    let actions = w.reconcile();
    assert!(fences(&actions).is_empty(), "{actions:?}");
    assert_eq!(w.state.incident, None, "nothing adopted");
    assert_eq!(w.state.reason, Some(Reason::Unprotected));
}
