//! Gangs in a drain: under `Whole` every member is told, then all leave
//! together or none does; under `Member` only the holder moves; under
//! `Never` the holder holds the step. Scenarios, then properties over
//! random gangs, tolerances, budgets and notices.

mod common;

use std::time::Duration;

use common::{BAD_GPU, World, gpu_pod};
use gpuhealth_api::{
    contract::{DisruptionTolerance, RemappedRows},
    gang::{GangKey, GangMode, GangSource},
    node_health::Phase,
    vocabulary::{PodKey, Reason},
};
use gpuhealth_engine::{
    budget::Fleet,
    drain::{BudgetView, PodView},
    gangs::{GangMember, GangView, GangWindow},
    happening::Happening,
    machine::Action,
};
use proptest::prelude::*;

fn train() -> GangKey {
    GangKey {
        source: GangSource::JobSet,
        namespace: "ml-serving".into(),
        name: "train".into(),
    }
}

/// The incident's node with every pod a rank of one JobSet, which has
/// `elsewhere` more ranks on other nodes (one per node, four a node).
fn gang_world(elsewhere: usize) -> World {
    let mut w = World::incident().with_dra();
    for p in &mut w.pods {
        p.gang = Some(train());
        p.workload = Some("Job/ml-serving/train-workers-0".into());
    }
    let mut members: Vec<GangMember> = w
        .pods
        .iter()
        .map(|p| GangMember {
            node: Some(w.node.name.clone()),
            pod: p.clone(),
        })
        .collect();
    for i in 0..elsewhere {
        let mut pod: PodView = gpu_pod(&format!("train-{i}"), &format!("GPU-other-{i}"));
        pod.gang = Some(train());
        members.push(GangMember {
            node: Some(format!("node-{}", i / 4)),
            pod,
        });
    }
    w.gangs = vec![GangView {
        key: train(),
        members,
        budgets: Vec::new(),
    }];
    w
}

#[test]
fn a_whole_gang_is_told_then_evicted_together_and_only_the_gpu_is_fenced() {
    let mut w = gang_world(24);
    w.run_until(
        |w| w.count(|a| matches!(a, Action::TellGangMember { .. })) > 0,
        Duration::from_secs(60),
    );
    let told: Vec<_> = w
        .log
        .iter()
        .filter_map(|a| match a {
            Action::TellGangMember { pod, at, .. } => Some((pod.clone(), *at)),
            _ => None,
        })
        .collect();
    assert_eq!(told.len(), 32, "every rank is told, on every node");
    let at = told[0].1;
    assert!(told.iter().all(|(_, t)| *t == at), "one time for all");
    assert!(
        w.said
            .iter()
            .any(|h| matches!(h, Happening::GangTold { members: 32, .. }))
    );
    assert_eq!(w.state.phase, Phase::Draining);
    assert!(
        w.state
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("JobSet ml-serving/train"),
        "{:?}",
        w.state.message
    );

    // Nothing leaves before the notice is out.
    while w.now < at {
        w.reconcile();
        assert!(w.gang_evicted.is_empty(), "evicted before {at}");
        w.advance(Duration::from_secs(10));
    }
    w.run_until(|w| !w.gang_evicted.is_empty(), Duration::from_secs(30));
    assert_eq!(w.gang_evicted.len(), 32, "all together, in one step");
    assert_eq!(w.count(|a| matches!(a, Action::Evict { .. })), 0);
    assert!(w.said.iter().any(|h| matches!(
        h,
        Happening::GangEvicted {
            members: 32,
            nodes: 7,
            ..
        }
    )));
    let record = &w.state.history[0].gangs[0];
    assert_eq!(record.gang, train());
    assert_eq!(record.mode, GangMode::Whole);
    assert_eq!((record.members, record.nodes.len()), (32, 7));
    assert!(record.evicted_at.is_some());

    w.run_until(
        |w| w.state.phase == Phase::Healthy,
        Duration::from_secs(600),
    );
    assert_eq!(w.reset_requests(), vec![vec![BAD_GPU.to_owned()]]);
    assert_eq!(
        w.count(|a| matches!(a, Action::Cordon { .. })),
        0,
        "only the GPU is fenced"
    );
    assert_eq!(w.count(|a| matches!(a, Action::TaintDevice { .. })), 1);
    assert_eq!(w.gang_evicted.len(), 32, "the restarted gang is left alone");
}

#[test]
fn a_gang_restarting_on_its_own_is_not_evicted_twice() {
    let mut w = gang_world(8);
    w.gangs[0].members[10].pod.terminating = true;
    w.run_until(
        |w| w.state.phase == Phase::Draining,
        Duration::from_secs(60),
    );
    w.reconcile();
    assert_eq!(w.count(|a| matches!(a, Action::TellGangMember { .. })), 0);
    assert!(w.state.history[0].gangs[0].restarted_on_its_own);
    // Its controller deletes the rest; the reset follows.
    let members: Vec<PodKey> = w.gangs[0].members.iter().map(|m| m.pod.key()).collect();
    for m in members {
        w.pods.retain(|p| p.key() != m);
    }
    w.gangs[0].members.clear();
    if let Some(Ok(r)) = &mut w.node.report {
        for g in &mut r.gpus {
            g.pods.clear();
        }
    }
    w.run_until(
        |w| w.state.phase == Phase::Healthy,
        Duration::from_secs(600),
    );
    assert!(w.gang_evicted.is_empty());
}

#[test]
fn member_moves_only_the_holder_and_never_holds_the_step() {
    let mut w = gang_world(8);
    w.spec.drain.gangs.mode = GangMode::Member;
    w.gangs.clear(); // not read under Member
    w.run_until(|w| !w.evicted().is_empty(), Duration::from_secs(60));
    assert_eq!(w.evicted(), ["ml-serving/vllm-7"]);
    assert_eq!(w.count(|a| matches!(a, Action::TellGangMember { .. })), 0);
    assert_eq!(w.state.history[0].gangs[0].mode, GangMode::Member);

    let mut w = gang_world(8);
    w.spec.drain.gangs.mode = GangMode::Never;
    w.run_until(
        |w| w.state.reason == Some(Reason::WaitingForPod),
        Duration::from_secs(60),
    );
    assert!(w.evicted().is_empty());
    assert!(
        w.state
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("Never"),
        "{:?}",
        w.state.message
    );
}

#[test]
fn a_whole_gang_counts_its_nodes_against_the_budget_while_it_is_taken_down() {
    let mut w = gang_world(8);
    w.run_until(
        |w| w.count(|a| matches!(a, Action::TellGangMember { .. })) > 0,
        Duration::from_secs(60),
    );
    let fleet = Fleet::count([("192.168.1.1", &w.state)]);
    let mut counted: Vec<&str> = fleet.disruptive.into_iter().collect();
    counted.sort();
    assert_eq!(counted, ["192.168.1.1", "node-0", "node-1"]);
    // A node of the gang takes nothing more out of service by starting:
    // it may, whatever maxConcurrent says; any other node waits.
    let budget = |node| {
        fleet_of(&w)
            .budget_for_one_more(&w.spec, 10, &[], &[])
            .for_node(&fleet_of(&w), node)
            .may_start()
    };
    assert_eq!(budget("node-0"), Ok(()));
    assert_eq!(
        budget("node-9"),
        Err(gpuhealth_engine::budget::Hold::Concurrency)
    );
}

fn fleet_of(w: &World) -> Fleet<'_> {
    Fleet::count([("192.168.1.1", &w.state)])
}

#[test]
fn a_dry_run_plan_says_what_would_become_of_the_gang() {
    let mut w = gang_world(8);
    w.spec.mode = gpuhealth_api::policy::Mode::DryRun;
    w.run_until(|w| w.state.plan.is_some(), Duration::from_secs(60));
    let plan = w.state.plan.clone().expect("a plan");
    assert_eq!(
        plan.gangs,
        [
            "JobSet ml-serving/train (Whole): its 16 members on 3 nodes would be told, then deleted together after 1m"
        ]
    );
    assert!(w.log.is_empty(), "a DryRun plan does nothing: {:?}", w.log);
}

fn window(nodes: &[&str]) -> GangWindow {
    GangWindow {
        gang: train(),
        node: "node-a".into(),
        incident: "inc-a".into(),
        evict_at: common::ts("2026-05-29T08:24:00Z"),
        nodes: nodes.iter().map(|n| n.to_string()).collect(),
    }
}

#[test]
fn a_repair_that_waits_for_a_reset_is_done_while_the_gang_is_down_anyway() {
    // Every GPU healthy; GPU 3 has a row remap pending until its next reset.
    let mut w = World::incident().with_dra();
    w.heal();
    if let Some(Ok(r)) = &mut w.node.report {
        for g in &mut r.gpus {
            g.xids.clear();
        }
        r.gpus[3].remapped_rows = Some(RemappedRows {
            pending: true,
            failure: false,
        });
    }
    let gpu3 = match &w.node.report {
        Some(Ok(r)) => r.gpus[3].uuid.clone(),
        _ => unreachable!(),
    };
    w.reconcile();
    assert_eq!(
        w.state.phase,
        Phase::Healthy,
        "no window: it waits for a reset"
    );

    // Another node's incident takes a gang that ran here down. A four-node
    // policy: that node remediating is all maxConcurrent (1) and
    // maxUnhealthy (1) allow, yet this node, disrupted with the gang
    // already and bringing a repair forward, takes neither.
    w.gang_windows = vec![window(&["node-a", "192.168.1.1"])];
    w.budget = gpuhealth_engine::budget::Budget {
        already_disrupted: true,
        ..gpuhealth_engine::budget::Budget::new(&w.spec, 4, 1, 2)
    };
    w.reconcile();
    assert_eq!(w.state.reason, Some(Reason::RepairedWithGang));
    let trigger = &w.state.history[0].trigger;
    assert!(
        trigger.contains("inc-a") && trigger.contains("JobSet ml-serving/train"),
        "{trigger}"
    );
    w.run_until(
        |w| w.state.phase == Phase::Healthy,
        Duration::from_secs(600),
    );
    assert_eq!(w.reset_requests(), vec![vec![gpu3]], "that GPU alone");
    assert_eq!(w.count(|a| matches!(a, Action::Cordon { .. })), 0);

    // A window of a gang that never ran here brings nothing forward.
    let mut w = World::incident().with_dra();
    w.heal();
    if let Some(Ok(r)) = &mut w.node.report {
        for g in &mut r.gpus {
            g.xids.clear();
        }
        r.gpus[3].remapped_rows = Some(RemappedRows {
            pending: true,
            failure: false,
        });
    }
    w.gang_windows = vec![window(&["node-a", "node-b"])];
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Healthy);
}

#[test]
fn of_two_incidents_taking_one_gang_the_first_told_leads() {
    let mut w = gang_world(8);
    // Node A told the gang first: this node's drain defers to it.
    w.gang_windows = vec![window(&["node-a", "192.168.1.1", "node-0", "node-1"])];
    w.run_until(
        |w| w.state.phase == Phase::Draining,
        Duration::from_secs(60),
    );
    w.reconcile();
    assert_eq!(
        w.count(|a| matches!(
            a,
            Action::TellGangMember { .. } | Action::EvictGangMember { .. }
        )),
        0
    );
    assert!(
        w.state
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("leaves with incident inc-a"),
        "{:?}",
        w.state.message
    );
    // A window told after this node's own notice does not lead.
    let own = w.state.history[0].gangs[0].evict_at.clone();
    assert!(own.is_none(), "never told here");
    let later = GangWindow {
        evict_at: common::ts("2030-01-01T00:00:00Z"),
        ..window(&[])
    };
    assert!(
        later.leads("192.168.1.1", None),
        "any window leads a round not told"
    );
    assert!(!later.leads("192.168.1.1", Some(common::ts("2029-01-01T00:00:00Z"))));
    assert!(!window(&[]).leads("node-a", None), "never its own");
}

/// A gang's first eviction, as one step decided it.
#[derive(Debug)]
struct Seen {
    evicted: usize,
    live: usize,
    budget_allowed: bool,
    notice_out: bool,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Under `Whole`, a gang is never left part gone: its first eviction
    /// takes every live member at once, never before the notice is out,
    /// never past a budget on it at zero, never with a member that may not
    /// go; and no member is ever evicted alone.
    #[test]
    fn a_gang_never_leaves_in_part(
        elsewhere in 0usize..12,
        odd in prop::option::of((0usize..20, 0u8..3)),
        allowed in prop::collection::vec(0i32..2, 1..6),
        notice in 0u64..120,
        restarting in any::<bool>(),
    ) {
        let mut w = gang_world(elsewhere);
        w.spec.drain.gangs.notice = gpuhealth_api::Duration::from_secs(notice);
        let n = w.gangs[0].members.len();
        if let Some((i, t)) = odd {
            let t = [DisruptionTolerance::Evict, DisruptionTolerance::Wait, DisruptionTolerance::Never][t as usize];
            let i = i % n;
            w.gangs[0].members[i].pod.tolerance = Ok(t);
            let key = w.gangs[0].members[i].pod.key();
            for p in w.pods.iter_mut().filter(|p| p.key() == key) {
                p.tolerance = Ok(t);
            }
        }
        if restarting {
            w.gangs[0].members[n - 1].pod.terminating = true;
        }
        let all: Vec<PodKey> = w.gangs[0].members.iter().map(|m| m.pod.key()).collect();
        w.gangs[0].budgets.push(BudgetView { name: "ml-serving/train".into(), allowed: allowed[0], pods: all.clone() });
        let may_not_go = w.gangs[0].members.iter().any(|m| m.pod.tolerance != Ok(DisruptionTolerance::Evict));
        let mut first: Option<Seen> = None;
        let mut told_at = None;
        for (round, a) in allowed.iter().cycle().take(40).enumerate() {
            w.gangs[0].budgets[0].allowed = *a;
            let live = w.gangs[0].members.iter().filter(|m| !m.pod.finished).count();
            let budget_allowed = *a > 0;
            let before = w.gang_evicted.len();
            let actions = w.reconcile();
            for act in &actions {
                if let Action::Evict { pod } | Action::ForceDelete { pod } = act {
                    prop_assert!(!all.contains(pod), "{pod} evicted alone, round {round}");
                }
                if let Action::TellGangMember { at, .. } = act {
                    told_at.get_or_insert(*at);
                }
            }
            let evicted = w.gang_evicted.len() - before;
            if evicted > 0 && first.is_none() {
                let notice_out = told_at.is_none_or(|at| w.now >= at);
                first = Some(Seen { evicted, live, budget_allowed, notice_out });
            }
            w.agent_turn();
            w.advance(Duration::from_secs(10));
        }
        if let Some(seen) = first {
            prop_assert_eq!(seen.evicted, seen.live, "part of the gang: {:?}", seen);
            prop_assert!(seen.budget_allowed, "past a budget at zero: {:?}", seen);
            prop_assert!(seen.notice_out, "before the notice was out: {:?}", seen);
            prop_assert!(!may_not_go, "a member that may not go went with the rest");
            prop_assert!(!restarting, "a gang restarting on its own was evicted again");
        }
    }
}
