//! What the node's agent says of itself in its report: what it can carry
//! out, whether it can read the GPUs, how fresh the report is, and whether
//! it knows who holds each GPU. The engine walks the incident with each.

mod common;

use std::time::Duration;

use common::{BAD_GPU, World};
use gpuhealth_api::{
    RecoveryAction,
    contract::{Capabilities, RebootMethod, XidEvent},
    node_health::{Phase, ReportProblemKind},
    policy::Mode,
    vocabulary::{Attempt, AttemptOutcome, FindingKind, Reason},
};
use gpuhealth_engine::{happening::Happening, machine::Action};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

const HOUR: Duration = Duration::from_secs(3600);

fn say(w: &mut World, change: impl FnOnce(&mut gpuhealth_api::contract::GpuReport)) {
    if let Some(Ok(report)) = &mut w.node.report {
        change(report);
    }
}

fn findings(w: &World, kind: FindingKind) -> Vec<String> {
    w.state
        .findings
        .iter()
        .filter(|f| f.type_ == kind)
        .map(|f| f.message.clone())
        .collect()
}

#[test]
fn a_rung_the_agent_cannot_carry_out_is_passed_over_not_requested() {
    let mut w = World::incident();
    say(&mut w, |r| {
        r.capabilities = Some(Capabilities {
            reset: false,
            reboot: RebootMethod::Logind,
        })
    });
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert_eq!(
        w.reset_requests(),
        Vec::<Vec<String>>::new(),
        "no reset requested"
    );
    assert_eq!(w.node.boot_id, "boot-2", "rebooted instead");
    assert_eq!(
        w.state.history[0].attempts,
        [
            Attempt::new(RecoveryAction::GpuReset, 1, AttemptOutcome::Skipped)
                .saying("the node's agent cannot reset a GPU (its report says reset: false)"),
            Attempt::new(RecoveryAction::NodeReboot, 1, AttemptOutcome::Succeeded),
        ]
    );
    let said = findings(&w, FindingKind::RungUnavailable);
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(said[0].starts_with("GpuReset passed over"), "{}", said[0]);
}

#[test]
fn an_agent_that_can_do_nothing_gets_no_request_and_a_dry_run_says_so() {
    let mut w = World::incident();
    let cannot = Capabilities {
        reset: false,
        reboot: RebootMethod::None,
    };
    say(&mut w, |r| r.capabilities = Some(cannot));
    w.spec.mode = Mode::DryRun;
    w.reconcile();
    let plan = w.state.plan.clone().expect("a plan");
    assert_eq!(plan.action, None, "no rung it could take");
    assert_eq!(plan.skipped.len(), 2, "{:?}", plan.skipped);
    assert!(
        plan.skipped[1].contains("does not reboot"),
        "{:?}",
        plan.skipped
    );

    w.spec.mode = Mode::Enforce;
    w.run_until(|w| w.state.phase == Phase::Failed, HOUR);
    assert_eq!(w.state.reason, Some(Reason::EscalationExhausted));
    assert!(w.reset_requests().is_empty());
    assert!(
        w.log
            .iter()
            .all(|a| !matches!(a, Action::RequestReboot { .. })),
        "no reboot requested"
    );
    assert!(w.node.unschedulable, "left cordoned for a person");
}

#[test]
fn a_stale_report_is_seen_and_never_acted_on() {
    let mut w = World::incident();
    w.clear();
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Healthy);
    assert!(w.state.report_problem.is_none());
    // The agent stops: its report is not refreshed for the bound.
    w.advance(Duration::from_secs(16 * 60));
    let actions = w.reconcile();
    assert!(actions.is_empty(), "{actions:?}");
    assert!(
        w.happenings.iter().any(|h| matches!(
            h,
            Happening::Found {
                kind: FindingKind::StaleReport,
                ..
            }
        )),
        "said: {:?}",
        w.happenings
    );
    assert_eq!(w.state.phase, Phase::Healthy);
    let problem = w.state.report_problem.clone().expect("stale");
    assert_eq!(problem.kind, ReportProblemKind::Stale);
    assert!(
        problem.message.contains("staleAfter (15m)"),
        "{}",
        problem.message
    );
    assert_eq!(findings(&w, FindingKind::StaleReport).len(), 1);
    // Refreshed again: seen.
    w.clear();
    w.reconcile();
    assert!(w.state.report_problem.is_none());
}

#[test]
fn a_report_the_agent_cannot_read_is_no_recovery() {
    let mut w = World::incident();
    w.run_until(|w| w.state.phase == Phase::Verifying, HOUR);
    // The reset is answered, but the agent then cannot read the GPUs: the
    // last GPUs it read look healthy, and must not count.
    let now = w.agent_now();
    say(&mut w, |r| {
        r.unreadable = Some("NVML did not answer within 30s".into());
        r.observed_at = Time(now);
        r.gpus.iter_mut().for_each(|g| {
            g.health = gpuhealth_api::GpuHealth::Healthy;
            g.xids.clear();
        });
    });
    for _ in 0..12 {
        w.reconcile();
        w.advance(Duration::from_secs(10));
    }
    assert_eq!(w.state.phase, Phase::Verifying, "not taken as recovered");
    assert_eq!(
        w.state.report_problem.as_ref().map(|p| p.kind),
        Some(ReportProblemKind::Unreadable)
    );
    assert_eq!(findings(&w, FindingKind::GpusUnreadable).len(), 1);
    say(&mut w, |r| r.unreadable = None);
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
}

#[test]
fn unknown_holders_widen_the_drain_and_say_why() {
    let mut w = World::incident();
    say(&mut w, |r| {
        for g in r.gpus.iter_mut().filter(|g| g.uuid == BAD_GPU) {
            g.pods.clear();
            g.pods_unknown = Some("the kubelet's PodResources: connection refused".into());
        }
    });
    w.spec.mode = Mode::DryRun;
    w.reconcile();
    let plan = w.state.plan.clone().expect("a plan");
    assert_eq!(plan.evict.len(), 8, "every GPU pod: {:?}", plan.evict);
    let why = plan.widened.expect("said");
    assert!(
        why.contains("who holds GPU 7 is not known (the kubelet's PodResources"),
        "{why}"
    );

    w.spec.mode = Mode::Enforce;
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert_eq!(
        w.evicted().len(),
        8,
        "drained wide, not left holding the GPU"
    );
    assert_eq!(w.reset_requests(), [vec![BAD_GPU.to_owned()]]);
}

/// The benchmark's next fault follows a recovery at once: an Xid on
/// another GPU, stamped (to the second, by the agent's clock) in the very
/// second the last incident closed, is new, not answered by that close.
#[test]
fn an_xid_in_the_second_an_incident_closes_opens_the_next() {
    let mut w = World::incident();
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    let closed = w.state.history[0].ended_at.clone().expect("closed");
    let other = say_xid(&mut w, 3, closed);
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Quarantined);
    assert_eq!(w.state.history.len(), 2, "a new incident");
    assert_eq!(w.state.history[0].gpus, [other]);

    // What the first incident's reset answered stays answered.
    let mut w = World::incident();
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    let answered = w.node.result.clone().expect("answered").expect("valid");
    say_xid(&mut w, 3, answered.finished_at);
    w.advance(Duration::from_secs(10));
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Healthy);
    assert_eq!(w.state.history.len(), 1);
}

/// Xid 119 on GPU `index` at `at`, in a report observed then; its UUID.
fn say_xid(w: &mut World, index: usize, at: Time) -> String {
    let mut uuid = String::new();
    say(w, |r| {
        r.observed_at = at.clone();
        let gpu = &mut r.gpus[index];
        gpu.xids.push(XidEvent::new(
            119,
            at,
            "Timeout after 45s of waiting for RPC response from GPU GSP",
        ));
        uuid.clone_from(&gpu.uuid);
    });
    uuid
}
