//! What the operator must read for a step: only what the step looks at.

mod common;

use std::time::Duration;

use common::World;
use gpuhealth_api::{
    GpuHealth,
    node_health::{GpuNodeHealthStatus, Phase},
    policy::Mode,
};
use gpuhealth_engine::{
    budget::Fleet,
    machine::{HoldersSince, needs},
};

const HOUR: Duration = Duration::from_secs(3600);

#[test]
fn a_healthy_node_with_the_same_holders_needs_no_pods() {
    let mut w = World::incident();
    w.heal();
    let n = needs(&w.spec, &w.state, &w.node, HoldersSince::Same);
    assert!(!n.pods && !n.gates_later && !n.disruption_budgets, "{n:?}");
    assert!(
        n.workloads.is_empty() && n.validation_pod.is_none(),
        "{n:?}"
    );
    // Other holders: their readiness gates may need setting.
    assert!(needs(&w.spec, &w.state, &w.node, HoldersSince::Changed).pods);
}

#[test]
fn a_new_bad_gpu_is_quarantined_first_and_its_pods_read_next() {
    let mut w = World::incident();
    w.spec.mode = Mode::Enforce;
    let first = needs(&w.spec, &w.state, &w.node, HoldersSince::Same);
    assert!(first.gates_later && !first.pods, "{first:?}");
    let next = needs(&w.spec, &w.state, &w.node, HoldersSince::GatesPending);
    assert!(next.pods && !next.gates_later, "{next:?}");
    // DryRun plans from the pods and their budgets at once.
    w.spec.mode = Mode::DryRun;
    let dry = needs(&w.spec, &w.state, &w.node, HoldersSince::Same);
    assert!(
        dry.pods && dry.disruption_budgets && !dry.gates_later,
        "{dry:?}"
    );
}

#[test]
fn a_node_under_remediation_always_needs_its_pods() {
    let mut w = World::incident();
    w.spec.mode = Mode::Enforce;
    w.run_until(|w| w.state.phase == Phase::Draining, HOUR);
    w.set_gpu_health(7, GpuHealth::Healthy);
    let n = needs(&w.spec, &w.state, &w.node, HoldersSince::Same);
    assert!(n.pods && !n.gates_later, "{n:?}");
}

#[test]
fn only_a_node_about_to_start_asks_for_the_budget() {
    // Counting the budget walks the policy's whole fleet: a healthy node,
    // or one already under remediation, must decide without it.
    let mut w = World::incident();
    w.spec.mode = Mode::Enforce;
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Quarantined);
    assert_eq!(w.budget_asked, 1, "the start asks, once");
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    for _ in 0..3 {
        w.reconcile();
    }
    assert_eq!(w.state.phase, Phase::Healthy);
    assert_eq!(w.budget_asked, 1, "asked again under way or once healthy");
    // Held for the budget, it asks at every look.
    let mut w = World::incident();
    w.spec.mode = Mode::Enforce;
    w.budget.disruptive_elsewhere = w.budget.max_concurrent;
    w.reconcile();
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Suspect);
    assert_eq!(w.budget_asked, 2);
}

#[test]
fn the_fleet_counts_disruptive_and_unhealthy_nodes_once() {
    let mut w = World::incident();
    w.spec.mode = Mode::Enforce;
    w.run_until(|w| w.state.phase == Phase::Draining, HOUR);
    let draining = w.state.clone();
    let healthy = Default::default();
    let fleet = Fleet::count([("a", &draining), ("b", &healthy)]);
    assert_eq!(fleet.disruptive.len(), 1);
    assert_eq!(fleet.unhealthy, 1);
    // Deciding for a third node: it counts itself too, and a node another
    // tool disrupts takes capacity unless already counted.
    let budget = fleet.budget_for_one_more(&w.spec, 10, &[], &["a".into(), "c".into()]);
    assert_eq!(budget.disruptive_elsewhere, 1);
    assert_eq!(budget.disrupted_by_others, 1);
    assert_eq!(budget.unhealthy, 2);
}

#[test]
fn a_recovered_node_counts_until_its_fence_is_lifted_and_a_handed_over_one_never() {
    let mut w = World::incident();
    w.spec.mode = Mode::Enforce;
    w.run_until(|w| w.state.phase == Phase::Draining, HOUR);
    let draining = w.state.clone();
    let recovered = Default::default();
    let failed = GpuNodeHealthStatus {
        phase: Phase::Failed,
        ..Default::default()
    };
    let fleet = Fleet::count([("a", &draining), ("b", &recovered), ("c", &failed)]);
    // `b` says Healthy but still carries the cordon; `c` is a person's;
    // `a` is counted once, fenced or not.
    let fenced = ["a".into(), "b".into(), "c".into()];
    let budget = fleet.budget_for_one_more(&w.spec, 10, &fenced, &["b".into()]);
    assert_eq!(budget.disruptive_elsewhere, 2);
    assert_eq!(budget.disrupted_by_others, 0, "b is counted once");
    let lifted = fleet.budget_for_one_more(&w.spec, 10, &["a".into(), "c".into()], &[]);
    assert_eq!(lifted.disruptive_elsewhere, 1);
}
