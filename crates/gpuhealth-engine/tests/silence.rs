//! A node a policy selects that never reports: said once its grace is over
//! (`staleAfter` from when a report was first awaited), in a finding, its
//! report problem and, under `Enforce`, its `GpuHealthy` condition; never
//! acted on, and cleared by the first report.

mod common;

use std::time::Duration;

use common::World;
use gpuhealth_api::{
    contract::GPU_HEALTHY_CONDITION,
    node_health::{Phase, ReportProblemKind},
    policy::Mode,
    vocabulary::FindingKind,
};
use gpuhealth_engine::{happening::Happening, machine::Action};

const GRACE: Duration = Duration::from_secs(15 * 60);

/// The incident's node, selected now with no report on it.
fn silent() -> World {
    let mut w = World::incident();
    w.clear();
    w.node.report = None;
    w.node.report_awaited_since = Some(w.now);
    w
}

fn said_no_report(w: &World) -> usize {
    w.happenings
        .iter()
        .filter(|h| {
            matches!(
                h,
                Happening::Found {
                    kind: FindingKind::NoReport,
                    ..
                }
            )
        })
        .count()
}

fn no_report_findings(w: &World) -> usize {
    w.state
        .findings
        .iter()
        .filter(|f| f.type_ == FindingKind::NoReport)
        .count()
}

fn gpu_healthy(w: &World) -> Option<&str> {
    w.node
        .conditions
        .iter()
        .find(|c| c.type_ == GPU_HEALTHY_CONDITION)
        .map(|c| c.status.as_str())
}

#[test]
fn a_node_that_never_reports_is_said_once_its_grace_is_over_and_never_acted_on() {
    let mut w = silent();
    let actions = w.reconcile();
    assert!(actions.is_empty(), "{actions:?}");
    assert_eq!(w.state.report_problem, None, "within its grace");
    assert_eq!(no_report_findings(&w), 0);
    assert_eq!(w.requeue, Some(GRACE), "looked at again as the grace ends");

    w.advance(GRACE - Duration::from_secs(1));
    w.reconcile();
    assert_eq!(w.state.report_problem, None, "a second before its end");
    assert_eq!(w.requeue, Some(Duration::from_secs(1)));

    w.advance(Duration::from_secs(1));
    let actions = w.reconcile();
    assert_eq!(said_no_report(&w), 1, "said: {:?}", w.happenings);
    assert_eq!(no_report_findings(&w), 1);
    assert_eq!(
        w.state.report_problem.as_ref().map(|p| p.kind),
        Some(ReportProblemKind::Missing)
    );
    assert_eq!(w.state.phase, Phase::Healthy, "the phase is left as it is");
    assert!(
        matches!(actions.as_slice(), [Action::MarkGpuHealthUnknown { message }] if message.contains("staleAfter (15m)")),
        "only the condition is written: {actions:?}"
    );
    assert_eq!(gpu_healthy(&w), Some("Unknown"));
    assert!(!w.node.unschedulable);

    // Once: neither the finding nor the condition again.
    w.advance(Duration::from_secs(10 * 60));
    let actions = w.reconcile();
    assert!(actions.is_empty(), "{actions:?}");
    assert_eq!(said_no_report(&w), 0);
    assert_eq!(no_report_findings(&w), 1);
    assert_eq!(w.requeue, None, "no poll while nothing changes");

    // A restarted operator awaits from its own start: what the status
    // says holds meanwhile, and is not said again.
    w.node.report_awaited_since = Some(w.now);
    w.advance(Duration::from_secs(60));
    w.reconcile();
    assert_eq!(said_no_report(&w), 0);
    assert_eq!(
        w.state.report_problem.as_ref().map(|p| p.kind),
        Some(ReportProblemKind::Missing)
    );
}

#[test]
fn the_first_report_clears_it() {
    let mut w = silent();
    w.advance(GRACE);
    w.reconcile();
    assert_eq!(no_report_findings(&w), 1);

    let report = World::incident().node.report;
    w.node.report = report;
    w.node.report_awaited_since = None;
    w.clear();
    w.reconcile();
    assert_eq!(w.state.report_problem, None);
    assert_eq!(no_report_findings(&w), 0, "{:?}", w.state.findings);
    assert_eq!(w.state.phase, Phase::Healthy);
    assert!(w.state.open_findings().next().is_none());

    // Gone again: a grace of its own before it is said again.
    w.node.report = None;
    w.node.report_awaited_since = Some(w.now);
    w.reconcile();
    assert_eq!(w.state.report_problem, None);
    w.advance(GRACE);
    w.reconcile();
    assert_eq!(said_no_report(&w), 1);
}

#[test]
fn dry_run_and_paused_say_it_and_leave_the_condition_alone() {
    for mode in [Mode::DryRun, Mode::Paused] {
        let mut w = silent();
        w.spec.mode = mode;
        w.advance(GRACE);
        let actions = w.reconcile();
        assert!(actions.is_empty(), "{mode:?}: {actions:?}");
        assert_eq!(said_no_report(&w), 1, "{mode:?}");
        assert_eq!(gpu_healthy(&w), None, "{mode:?}");
    }
}

#[test]
fn a_condition_already_unknown_is_left_as_it_is() {
    let mut w = silent();
    w.node
        .conditions
        .push(gpuhealth_engine::diagnosis::ObservedCondition {
            type_: GPU_HEALTHY_CONDITION.into(),
            status: "Unknown".into(),
            last_transition: w.now,
        });
    w.advance(GRACE);
    let actions = w.reconcile();
    assert!(actions.is_empty(), "{actions:?}");
    assert_eq!(said_no_report(&w), 1);
}
