//! The rules of DESIGN.md as properties of the engine, over random sequences
//! of observations: health flapping, Xids, foreign cordons, pod tolerances,
//! budgets, mode switches and agents that succeed, fail or stay silent.

mod common;

use std::time::Duration;

use common::{Agent, World, gpu_pod};
use gpuhealth_api::{
    GpuHealth,
    contract::{Capabilities, DisruptionTolerance, RebootMethod, RequestId, XidEvent},
    node_health::Phase,
    policy::Mode,
};
use gpuhealth_engine::{
    budget::Budget,
    machine::{Action, is_disruptive},
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Event {
    Tick(u64),
    Health(usize, GpuHealth),
    Xid(usize, u32),
    ForeignCordon(bool),
    Tolerance(usize, u8),
    PodLeaves(usize),
    PodArrives(usize),
    Budget {
        elsewhere: usize,
        unhealthy: usize,
    },
    Mode(Mode),
    ResetAgent(Agent),
    RebootAgent(Agent),
    AgentTurn,
    /// The operator died between recording a request and writing it.
    RequestLost,
    /// The next uncordon is refused (a conflict with another writer).
    UncordonRefused,
    /// The agent says what it can carry out (or says nothing).
    Capabilities(Option<Capabilities>),
    Reconcile,
}

fn capabilities() -> impl Strategy<Value = Option<Capabilities>> {
    let reboot = prop_oneof![
        Just(RebootMethod::None),
        Just(RebootMethod::Logind),
        Just(RebootMethod::Kured)
    ];
    prop::option::of(
        (any::<bool>(), reboot).prop_map(|(reset, reboot)| Capabilities { reset, reboot }),
    )
}

fn health() -> impl Strategy<Value = GpuHealth> {
    prop_oneof![
        Just(GpuHealth::Healthy),
        Just(GpuHealth::Degraded),
        Just(GpuHealth::ResetRequired),
        Just(GpuHealth::RebootRequired),
        Just(GpuHealth::Lost),
    ]
}

fn agent() -> impl Strategy<Value = Agent> {
    prop_oneof![
        Just(Agent::Succeeds),
        Just(Agent::Fails),
        Just(Agent::Silent)
    ]
}

fn event() -> impl Strategy<Value = Event> {
    prop_oneof![
        4 => (1u64..900).prop_map(Event::Tick),
        2 => (0usize..8, health()).prop_map(|(g, h)| Event::Health(g, h)),
        1 => (0usize..8, prop::sample::select(vec![13u32, 31, 48, 79, 119, 154, 4242])).prop_map(|(g, x)| Event::Xid(g, x)),
        1 => any::<bool>().prop_map(Event::ForeignCordon),
        1 => (0usize..8, 0u8..4).prop_map(|(p, t)| Event::Tolerance(p, t)),
        1 => (0usize..8).prop_map(Event::PodLeaves),
        1 => (0usize..8).prop_map(Event::PodArrives),
        1 => (0usize..3, 0usize..10).prop_map(|(elsewhere, unhealthy)| Event::Budget { elsewhere, unhealthy }),
        1 => prop_oneof![Just(Mode::Enforce), Just(Mode::DryRun), Just(Mode::Paused)].prop_map(Event::Mode),
        1 => agent().prop_map(Event::ResetAgent),
        1 => agent().prop_map(Event::RebootAgent),
        3 => Just(Event::AgentTurn),
        1 => Just(Event::RequestLost),
        1 => Just(Event::UncordonRefused),
        1 => capabilities().prop_map(Event::Capabilities),
        6 => Just(Event::Reconcile),
    ]
}

/// The rules of DESIGN.md, one property each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rule {
    /// Uncordon only a node gpuhealth cordoned; cordon only an uncordoned one
    /// (or take over its own cordon left from the last incident).
    OwnCordonOnly,
    /// Never evict (or force-delete) a pod whose tolerance is `never` or unreadable.
    NeverPodsStay,
    /// Every request is recorded in the status written before it, and a
    /// request written again is the recorded one, time included.
    IntentFirst,
    /// DryRun and Paused take no side effect.
    NoSideEffectsUnlessEnforced,
    /// No remediation starts beyond maxConcurrent or with the breaker open.
    StartOnlyWithinBudget,
    /// No rung is started that the node's agent says it cannot carry out (a
    /// request already made is written again as it was).
    OnlyWhatTheAgentCanDo,
    /// No reset or reboot is requested (first or again) while a pod the
    /// drain may not pass over holds a GPU the request covers: holders are
    /// a watched set, and a pod that comes after the drain is drained too.
    NoRequestWhileHeld,
}

/// Applies a world event; returns the violations found by a reconcile.
fn apply(w: &mut World, e: &Event) -> Vec<(Rule, String)> {
    match e {
        Event::Tick(s) => w.advance(Duration::from_secs(*s)),
        Event::Health(g, h) => {
            if let Some(Ok(r)) = &mut w.node.report {
                r.gpus[*g].health = *h;
                r.observed_at = Time(w.now);
            }
        }
        Event::Xid(g, code) => {
            if let Some(Ok(r)) = &mut w.node.report {
                let text = if *code == 154 {
                    "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)"
                } else {
                    ""
                };
                r.gpus[*g]
                    .xids
                    .push(XidEvent::new(*code, Time(w.now), text));
                r.gpus[*g].xids.truncate(32);
            }
        }
        Event::ForeignCordon(on) => {
            // A person or another tool; it never writes our record.
            if w.node.cordoned_by.is_none() {
                w.node.unschedulable = *on;
            }
        }
        Event::Tolerance(p, t) => {
            if let Some(pod) = w.pods.get_mut(*p) {
                pod.tolerance = match t {
                    0 => Ok(DisruptionTolerance::Evict),
                    1 => Ok(DisruptionTolerance::Wait),
                    2 => Ok(DisruptionTolerance::Never),
                    _ => "sometimes".parse(),
                };
            }
        }
        Event::PodLeaves(p) => {
            if *p < w.pods.len() {
                w.pods.remove(*p);
            }
        }
        Event::PodArrives(g) => {
            let uuid = format!("GPU-0a1b2c3d-0000-4000-8000-{g:012}");
            // Pod names are unique on a node, as in Kubernetes.
            let name = (0..)
                .map(|n| format!("late-{n}"))
                .find(|n| w.pods.iter().all(|p| &p.name != n));
            w.pods.push(gpu_pod(&name.unwrap_or_default(), &uuid));
        }
        Event::Budget {
            elsewhere,
            unhealthy,
        } => {
            w.budget.disruptive_elsewhere = *elsewhere;
            w.budget.unhealthy = *unhealthy;
        }
        Event::Mode(m) => w.spec.mode = *m,
        Event::ResetAgent(a) => w.reset_agent = *a,
        Event::RebootAgent(a) => w.reboot_agent = *a,
        Event::AgentTurn => w.agent_turn(),
        Event::RequestLost => {
            w.node.reset_request = None;
            w.node.reboot_request = None;
        }
        Event::UncordonRefused => w.refused_uncordons += 1,
        Event::Capabilities(c) => {
            if let Some(Ok(r)) = &mut w.node.report {
                r.capabilities = *c;
            }
        }
        Event::Reconcile => return reconcile_checked(w),
    }
    Vec::new()
}

/// One reconcile, checking every rule against what the engine saw.
fn reconcile_checked(w: &mut World) -> Vec<(Rule, String)> {
    let mut bad = Vec::new();
    let before = w.state.clone();
    let node = w.node.clone();
    let pods = w.pods.clone();
    let budget = w.budget;
    let mode = w.spec.mode;
    let actions = w.reconcile();
    let after = &w.state;
    let can = match &node.report {
        Some(Ok(r)) => r.capabilities,
        _ => None,
    };
    let made_before = |id: &RequestId| {
        before
            .action
            .as_ref()
            .is_some_and(|x| &x.id == id && x.requested_at.is_some())
    };
    let excluded = w.spec.drain.exclude_namespaces.clone();
    let holder = |covers: &dyn Fn(&gpuhealth_engine::drain::PodView) -> bool| {
        pods.iter()
            .filter(|p| !p.daemon && !p.mirror && !p.finished)
            .filter(|p| !excluded.contains(&p.namespace))
            .find(|p| covers(p))
            .map(|p| p.key().to_string())
    };
    for a in &actions {
        let held = match a {
            Action::RequestReset { gpus, .. } => {
                holder(&|p| p.gpus.iter().any(|g| gpus.contains(g)))
            }
            Action::RequestReboot { .. } => holder(&|p| p.requests_gpu),
            _ => None,
        };
        if let Some(pod) = held {
            bad.push((
                Rule::NoRequestWhileHeld,
                format!("{a:?} while {pod} holds a GPU it covers"),
            ));
        }
        let refused = match a {
            Action::RequestReset { id, .. } if !made_before(id) => can.is_some_and(|c| !c.reset),
            Action::RequestReboot { id, .. } if !made_before(id) => {
                can.is_some_and(|c| c.reboot == RebootMethod::None)
            }
            _ => false,
        };
        if refused {
            bad.push((
                Rule::OnlyWhatTheAgentCanDo,
                format!("requested {a:?} of an agent that says {can:?}"),
            ));
        }
        match a {
            Action::Uncordon { incident } if node.cordoned_by.as_ref() != Some(incident) => {
                bad.push((
                    Rule::OwnCordonOnly,
                    format!("uncordoned a cordon that is not ours: {node:?}"),
                ));
            }
            // Unless the cordon is ours, left from the last incident.
            Action::Cordon { .. }
                if node.unschedulable
                    && (node.cordoned_by.is_none()
                        || node.cordoned_by.as_deref()
                            != before.history.first().map(|i| i.id.as_str())) =>
            {
                bad.push((
                    Rule::OwnCordonOnly,
                    "cordoned an already cordoned node".into(),
                ))
            }
            Action::Evict { pod } | Action::ForceDelete { pod } => {
                if let Some(p) = pods.iter().find(|p| &p.key() == pod)
                    && !matches!(
                        p.tolerance,
                        Ok(DisruptionTolerance::Evict) | Ok(DisruptionTolerance::Wait)
                    )
                {
                    bad.push((
                        Rule::NeverPodsStay,
                        format!("evicted {pod} whose tolerance is {:?}", p.tolerance),
                    ));
                }
            }
            Action::RequestReset {
                id, requested_at, ..
            }
            | Action::RequestReboot { id, requested_at }
                if after
                    .action
                    .as_ref()
                    .map(|x| (&x.id, x.requested_at.as_ref().map(|t| t.0)))
                    != Some((id, Some(*requested_at))) =>
            {
                bad.push((
                    Rule::IntentFirst,
                    format!(
                        "request {id} at {requested_at} is not the one recorded in the status written before it"
                    ),
                ));
            }
            _ => {}
        }
        if mode != Mode::Enforce {
            bad.push((
                Rule::NoSideEffectsUnlessEnforced,
                format!("{mode:?} took a side effect: {a:?}"),
            ));
        }
    }
    let started =
        !is_disruptive(before.phase) && before.phase != Phase::Failed && is_disruptive(after.phase);
    if started && (budget.may_start().is_err() || mode != Mode::Enforce) {
        bad.push((
            Rule::StartOnlyWithinBudget,
            format!("started a remediation with budget {budget:?} in mode {mode:?}"),
        ));
    }
    bad
}

fn histories() -> impl Strategy<Value = Vec<Event>> {
    prop::collection::vec(event(), 1..120)
}

/// Plays `events` on the incident node, failing at the first breach of `rule`.
fn holds(rule: Rule, events: &[Event]) -> Result<(), TestCaseError> {
    let mut w = World::incident();
    for e in events {
        let bad: Vec<String> = apply(&mut w, e)
            .into_iter()
            .filter(|(r, _)| *r == rule)
            .map(|(_, why)| why)
            .collect();
        prop_assert!(bad.is_empty(), "after {e:?}: {bad:?}");
    }
    Ok(())
}

// 256 cases each by default; PROPTEST_CASES=N runs more.
proptest! {
    #[test]
    fn never_uncordons_a_foreign_cordon(events in histories()) {
        holds(Rule::OwnCordonOnly, &events)?;
    }

    #[test]
    fn never_evicts_a_never_pod(events in histories()) {
        holds(Rule::NeverPodsStay, &events)?;
    }

    #[test]
    fn requests_only_what_the_agent_can_carry_out(events in histories()) {
        holds(Rule::OnlyWhatTheAgentCanDo, &events)?;
    }

    #[test]
    fn never_requests_while_a_pod_holds_a_covered_gpu(events in histories()) {
        holds(Rule::NoRequestWhileHeld, &events)?;
    }

    #[test]
    fn records_intent_before_every_request(events in histories()) {
        holds(Rule::IntentFirst, &events)?;
    }

    #[test]
    fn dry_run_and_paused_take_no_side_effect(events in histories()) {
        holds(Rule::NoSideEffectsUnlessEnforced, &events)?;
    }

    #[test]
    fn never_starts_while_the_breaker_is_open_or_the_budget_is_spent(events in histories()) {
        holds(Rule::StartOnlyWithinBudget, &events)?;
    }

    /// Several nodes of one policy, each deciding with the others' latest
    /// phases: never more than `maxConcurrent` of them disruptive at once.
    #[test]
    fn never_more_than_max_concurrent(
        max_concurrent in 1i32..3,
        order in prop::collection::vec((0usize..4, 1u64..120, any::<bool>()), 1..200),
    ) {
        let mut nodes: Vec<World> = (0..4).map(|_| World::incident()).collect();
        for n in &mut nodes {
            n.spec.max_concurrent = k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(max_concurrent);
            n.spec.max_unhealthy = k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(4);
        }
        for (i, secs, agent_turn) in order {
            let elsewhere = nodes.iter().enumerate().filter(|(j, n)| *j != i && is_disruptive(n.state.phase)).count();
            let n = &mut nodes[i];
            n.budget = Budget::new(&n.spec, 4, elsewhere, 4);
            n.reconcile();
            if agent_turn {
                n.agent_turn();
            }
            for m in &mut nodes {
                m.advance(Duration::from_secs(secs));
            }
            let disruptive = nodes.iter().filter(|n| is_disruptive(n.state.phase)).count();
            prop_assert!(disruptive <= max_concurrent as usize, "{disruptive} disruptive nodes, maxConcurrent {max_concurrent}");
        }
    }

    /// Nodes other tools are disrupting count against `maxConcurrent` as
    /// gpuhealth's own do: it never starts a remediation that would take
    /// more nodes out than the policy allows, and never takes a disruptive
    /// step on a node another tool is disrupting.
    #[test]
    fn foreign_disruptions_count_against_max_concurrent(
        max_concurrent in 1i32..3,
        order in prop::collection::vec(
            (0usize..4, 1u64..120, any::<bool>(), prop::option::of(0usize..4)),
            1..200,
        ),
    ) {
        let mut nodes: Vec<World> = (0..4).map(|_| World::incident()).collect();
        let mut foreign = [false; 4];
        for n in &mut nodes {
            n.spec.max_concurrent = k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(max_concurrent);
            n.spec.max_unhealthy = k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(4);
        }
        for (i, secs, agent_turn, toggle) in order {
            if let Some(j) = toggle {
                foreign[j] = !foreign[j];
                nodes[j].node.disrupted_by = if foreign[j] {
                    vec!["gpu-operator: label nvidia.com/gpu-driver-upgrade-state=upgrade-required".into()]
                } else {
                    Vec::new()
                };
            }
            let ours = nodes.iter().enumerate().filter(|(j, n)| *j != i && is_disruptive(n.state.phase)).count();
            let others = nodes
                .iter()
                .enumerate()
                .filter(|(j, n)| *j != i && foreign[*j] && !is_disruptive(n.state.phase))
                .count();
            let n = &mut nodes[i];
            let before = is_disruptive(n.state.phase);
            n.budget = Budget::new(&n.spec, 4, ours, 4).with_others(others);
            let actions = n.reconcile();
            if !before && is_disruptive(n.state.phase) {
                prop_assert!(
                    ours + others < max_concurrent as usize,
                    "started with {ours} of ours and {others} of others' nodes out, maxConcurrent {max_concurrent}"
                );
            }
            if foreign[i] {
                let disruptive_step = actions.iter().find(|a| matches!(
                    a,
                    Action::Cordon { .. } | Action::Evict { .. } | Action::ForceDelete { .. }
                        | Action::RequestReset { .. } | Action::RequestReboot { .. }
                ));
                prop_assert!(disruptive_step.is_none(), "{disruptive_step:?} on a node another tool is disrupting");
            }
            if agent_turn {
                n.agent_turn();
            }
            for m in &mut nodes {
                m.advance(Duration::from_secs(secs));
            }
        }
    }
}
