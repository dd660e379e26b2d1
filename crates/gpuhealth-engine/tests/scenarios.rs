//! The engine walked through the incident and its harder variants, with no
//! server: the in-memory world applies its actions as the operator would.
//!
//! Long because each test is one whole story, short on its own, and they
//! share one simulated world.

mod common;

use std::time::Duration;

use common::{Agent, BAD_GPU, World, gpu_pod, ts};
use gpuhealth_api::{
    GpuHealth,
    contract::{DisruptionTolerance, RequestId, XidEvent},
    node_health::Phase,
    policy::{
        ConditionRule, ConditionStatus, ConditionWriter, EscalationStep, Mode, ValidationPod,
    },
    types::{RecoveryAction, SignalAction},
    vocabulary::{
        Attempt, AttemptAction, AttemptOutcome, FindingKind, IncidentOutcome, PodKey, Reason,
    },
};
use gpuhealth_engine::{
    diagnosis::ObservedCondition, drain::BudgetView, happening::Happening, machine::Action,
};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::SignedDuration};

const HOUR: Duration = Duration::from_secs(3600);

fn attempt(action: impl Into<AttemptAction>, n: u32, outcome: AttemptOutcome) -> Attempt {
    Attempt::new(action, n, outcome)
}

#[test]
fn the_incident_resets_one_gpu_and_returns_to_healthy() {
    let mut w = World::incident();
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Quarantined);
    assert!(w.node.unschedulable, "cordoned in the first step");
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);

    assert_eq!(
        w.evicted(),
        ["ml-serving/vllm-7"],
        "only the pod on GPU 7 leaves"
    );
    assert_eq!(
        w.pods.len(),
        7,
        "the pods on the other seven GPUs keep running"
    );
    assert_eq!(
        w.reset_requests(),
        [vec![BAD_GPU.to_owned()]],
        "one reset, of exactly that GPU"
    );
    assert!(!w.node.unschedulable, "uncordoned");
    let incident = &w.state.history[0];
    assert_eq!(incident.outcome, Some(IncidentOutcome::Recovered));
    assert_eq!(
        incident.attempts,
        [attempt(
            RecoveryAction::GpuReset,
            1,
            AttemptOutcome::Succeeded
        )]
    );
    assert!(incident.trigger.contains("GPU 7"), "{}", incident.trigger);
    let entered: Vec<Reason> = w
        .said
        .iter()
        .filter_map(|h| match h {
            Happening::Entered { reason, .. } => Some(*reason),
            _ => None,
        })
        .collect();
    for expected in [Reason::Draining, Reason::ActionRequested, Reason::Verifying] {
        assert!(
            entered.contains(&expected),
            "said it entered {expected}: {entered:?}"
        );
    }
    assert!(
        w.said.iter().any(|h| matches!(
            h,
            Happening::Closed {
                outcome: IncidentOutcome::Recovered,
                ..
            }
        )),
        "said it recovered: {:?}",
        w.said
    );
}

/// Found by the benchmark: a fault that cleared between the cordon and the
/// reset left nothing for the request to name, the agent refused the empty
/// request, and the operator asked again many times a second.
#[test]
fn a_fault_that_clears_before_the_reset_still_resets_the_incidents_gpu() {
    let mut w = World::incident();
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Quarantined);
    w.clear();
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert_eq!(
        w.reset_requests(),
        [vec![BAD_GPU.to_owned()]],
        "one reset, of the incident's GPU"
    );
}

/// A condition names no GPU: its reset names every GPU the report lists,
/// and with no report to list any, the ladder moves on to a reboot.
#[test]
fn a_condition_resets_every_gpu_and_without_a_report_reboots() {
    let condition_world = |report: bool| {
        let mut w = World::incident();
        w.clear();
        if !report {
            w.node.report = None;
        }
        w.spec.detection.node_conditions.push(ConditionRule {
            type_: "GpuFailed".into(),
            status: ConditionStatus::True,
            for_: "0s".parse().expect("duration"),
            action: SignalAction::GpuReset,
            writers: vec![ConditionWriter::group("system:nodes")],
        });
        w.node.conditions.push(ObservedCondition {
            type_: "GpuFailed".into(),
            status: "True".into(),
            last_transition: w.now,
        });
        w
    };
    let requests = |w: &World| -> Vec<Action> {
        w.log
            .iter()
            .filter(|a| {
                matches!(
                    a,
                    Action::RequestReset { .. } | Action::RequestReboot { .. }
                )
            })
            .cloned()
            .collect()
    };

    let mut w = condition_world(true);
    w.run_until(|w| w.state.phase == Phase::Remediating, HOUR);
    match requests(&w).as_slice() {
        [Action::RequestReset { gpus, .. }] => assert_eq!(gpus.len(), 8, "{gpus:?}"),
        other => panic!("one reset of every GPU, not {other:?}"),
    }

    let mut w = condition_world(false);
    w.run_until(|w| w.state.phase == Phase::Remediating, HOUR);
    assert!(
        matches!(requests(&w).as_slice(), [Action::RequestReboot { .. }]),
        "{:?}",
        requests(&w)
    );
    assert_eq!(
        w.state.history[0].attempts,
        [attempt(RecoveryAction::GpuReset, 1, AttemptOutcome::Skipped).saying("no GPU to name")]
    );
}

/// Nothing said delays an action: what a step says is no action at all.
#[test]
fn the_cordon_is_the_first_action_and_what_is_said_is_no_action() {
    let mut w = World::incident();
    let actions = w.reconcile();
    assert!(
        matches!(actions.first(), Some(Action::Cordon { .. })),
        "{actions:?}"
    );
    // The finding and the transition are said.
    assert!(
        w.happenings.iter().any(|h| matches!(
            h,
            Happening::Found {
                kind: FindingKind::PodOnBadGpu,
                ..
            }
        )),
        "the finding: {:?}",
        w.happenings
    );
    assert!(
        w.happenings.iter().any(|h| matches!(
            h,
            Happening::Entered {
                phase: Phase::Quarantined,
                ..
            }
        )),
        "the transition: {:?}",
        w.happenings
    );
    // Cordoned for a report that shows a bad GPU: its time is told.
    let observed = match &w.node.report {
        Some(Ok(r)) => r.observed_at.0,
        other => panic!("a report: {other:?}"),
    };
    assert!(
        w.happenings.contains(&Happening::QuarantinedForReport {
            observed_at: observed
        }),
        "{:?}",
        w.happenings
    );
}

#[test]
fn a_failed_reset_escalates_to_a_reboot() {
    let mut w = World::incident();
    w.reset_agent = Agent::Fails;
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert_eq!(w.node.boot_id, "boot-2", "the node was rebooted");
    assert_eq!(
        w.state.history[0].attempts,
        [
            attempt(RecoveryAction::GpuReset, 1, AttemptOutcome::Failed),
            attempt(RecoveryAction::NodeReboot, 1, AttemptOutcome::Succeeded)
        ]
    );
    assert!(w.pods.is_empty(), "a reboot drains every pod");
}

#[test]
fn when_everything_fails_the_node_stays_cordoned_for_a_person() {
    let mut w = World::incident();
    w.reset_agent = Agent::Fails;
    w.reboot_agent = Agent::Fails;
    w.run_until(|w| w.state.phase == Phase::Failed, HOUR);
    assert!(w.node.unschedulable);
    assert_eq!(w.state.reason, Some(Reason::EscalationExhausted));
    let message = w.state.message.clone().unwrap_or_default();
    assert!(
        message.contains("inspect") && message.contains("uncordon"),
        "{message}"
    );
    assert_eq!(w.state.history[0].outcome, Some(IncidentOutcome::Failed));
    // It stays Failed until a person uncordons it.
    w.advance(HOUR);
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Failed);
    assert!(w.count(|a| matches!(a, Action::Uncordon { .. })) == 0);
}

#[test]
fn a_person_s_uncordon_of_a_handed_over_node_leaves_no_record_to_claim_their_next_cordon() {
    let mut w = World::incident();
    w.reset_agent = Agent::Fails;
    w.reboot_agent = Agent::Fails;
    w.run_until(|w| w.state.phase == Phase::Failed, HOUR);
    assert!(w.node.cordoned_by.is_some());
    // A person repairs the node and uncordons it as kubectl does: the
    // record stays behind, and gpuhealth forgets it.
    w.clear();
    w.node.unschedulable = false;
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Healthy);
    assert_eq!(w.node.cordoned_by, None);
    // Their next cordon is theirs: the next incident keeps it, never lifts it.
    w.advance(HOUR);
    w.reset_agent = Agent::Succeeds;
    w.node.unschedulable = true;
    w.set_gpu_health(2, GpuHealth::ResetRequired);
    w.run_until(
        |w| w.state.phase == Phase::Healthy && w.state.incident.is_none(),
        HOUR,
    );
    assert!(w.node.unschedulable, "a person's cordon is never lifted");
    assert_eq!(w.count(|a| matches!(a, Action::Uncordon { .. })), 0);
}

#[test]
fn a_silent_agent_times_out_and_escalates() {
    let mut w = World::incident();
    w.reset_agent = Agent::Silent;
    w.run_until(|w| w.state.phase == Phase::Healthy, 2 * HOUR);
    assert_eq!(
        w.state.history[0].attempts,
        [
            attempt(RecoveryAction::GpuReset, 1, AttemptOutcome::Failed),
            attempt(RecoveryAction::NodeReboot, 1, AttemptOutcome::Succeeded)
        ]
    );
}

#[test]
fn xid_79_starts_at_the_reboot_rung_and_drains_everything() {
    let mut w = World::incident();
    if let Some(Ok(report)) = &mut w.node.report {
        let gpu = &mut report.gpus[3];
        gpu.xids.push(XidEvent::new(
            79,
            Time(w.now),
            "GPU has fallen off the bus.",
        ));
        gpu.health = GpuHealth::Lost;
    }
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert_eq!(w.count(|a| matches!(a, Action::RequestReset { .. })), 0);
    assert_eq!(
        w.state.history[0].attempts,
        [attempt(
            RecoveryAction::NodeReboot,
            1,
            AttemptOutcome::Succeeded
        )]
    );
    assert_eq!(w.evicted().len(), 8);
}

#[test]
fn someone_elses_cordon_is_left_in_place() {
    let mut w = World::incident();
    w.node.unschedulable = true; // cordoned by a person, with no record of ours
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert_eq!(w.count(|a| matches!(a, Action::Cordon { .. })), 0);
    assert_eq!(w.count(|a| matches!(a, Action::Uncordon { .. })), 0);
    assert!(w.node.unschedulable, "still cordoned");
    let recovered = w.said.iter().find_map(|h| match h {
        Happening::Closed {
            outcome: IncidentOutcome::Recovered,
            message,
            ..
        } => Some(message.clone()),
        _ => None,
    });
    assert!(recovered.is_some_and(|m| m.contains("someone else cordoned it")));
}

/// Found by the chaos runs: the uncordon after a recovery was refused as a
/// conflict (another writer had replaced the node), and every later
/// reconcile, starting from Healthy, left gpuhealth's cordon in place.
#[test]
fn an_uncordon_that_did_not_land_is_carried_out_later() {
    let mut w = World::incident();
    w.refused_uncordons = 1;
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert!(w.node.unschedulable, "the first uncordon was refused");
    let ours = w.state.history[0].id.clone();
    assert_eq!(w.node.cordoned_by.as_ref(), Some(&ours));

    let actions = w.reconcile();
    assert_eq!(
        actions
            .iter()
            .filter(|a| matches!(a, Action::Uncordon { incident } if *incident == ours))
            .count(),
        1,
        "{actions:?}"
    );
    assert!(!w.node.unschedulable && w.node.cordoned_by.is_none());
    assert_eq!(w.state.phase, Phase::Healthy);
    assert!(w.reconcile().is_empty(), "nothing more to do");
}

/// A person's cordon after the recovery is not ours: it has no record.
#[test]
fn a_cordon_without_our_record_after_a_recovery_stays() {
    let mut w = World::incident();
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    w.node.unschedulable = true;
    w.advance(Duration::from_secs(60));
    w.reconcile();
    assert!(w.node.unschedulable);
    assert_eq!(w.count(|a| matches!(a, Action::Uncordon { .. })), 1);
}

/// A new fault before the leftover cordon is lifted: the new incident takes
/// the cordon over (its own record), and lifts it when it recovers.
#[test]
fn a_new_incident_takes_over_a_leftover_cordon() {
    let mut w = World::incident();
    w.refused_uncordons = 1;
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert!(w.node.unschedulable);
    w.advance(HOUR);
    w.set_gpu_health(2, GpuHealth::ResetRequired);
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Quarantined);
    let second = w.state.incident.clone();
    assert!(second.is_some() && second != Some(w.state.history[1].id.clone()));
    assert_eq!(
        w.node.cordoned_by, second,
        "the record names the new incident"
    );
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert!(
        !w.node.unschedulable,
        "uncordoned after the second recovery"
    );
}

#[test]
fn a_never_pod_holds_the_node_until_it_goes() {
    let mut w = World::incident();
    w.pods[7].tolerance = Ok(DisruptionTolerance::Never);
    w.run_until(|w| w.state.reason == Some(Reason::WaitingForPod), HOUR);
    let message = w.state.message.clone().unwrap_or_default();
    assert!(
        message.contains("ml-serving/vllm-7"),
        "the reason names the pod: {message}"
    );
    w.advance(Duration::from_secs(60));
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Draining);
    assert!(w.evicted().is_empty(), "never evicted");
    // Its owner moves it away; remediation continues.
    w.pods.retain(|p| p.name != "vllm-7");
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert!(w.evicted().is_empty());
}

#[test]
fn an_incident_names_its_node_and_keeps_the_signals_it_opened_on() {
    let mut w = World::incident();
    w.reconcile();
    let opened = w.state.history[0].clone();
    let second = w.now.as_second();
    assert_eq!(
        opened.id,
        RequestId::for_incident(&w.node.name, second).to_string()
    );
    // Among signals asking for the same action, an Xid names the incident.
    assert!(
        opened.trigger.starts_with("Xid 119 on GPU 7"),
        "{}",
        opened.trigger
    );
    let xids: Vec<u32> = opened
        .signals
        .iter()
        .filter_map(|s| s.xid.as_ref().map(|x| x.code))
        .collect();
    assert_eq!(xids, [119, 154], "{:?}", opened.signals);
    assert!(
        opened
            .signals
            .iter()
            .any(|s| s.reason == Reason::GpuResetRequired),
        "the GPU's state too: {:?}",
        opened.signals
    );
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    w.clear();
    w.reconcile();
    assert_eq!(
        w.state.history[0].signals, opened.signals,
        "the report moved on, the record did not"
    );
    // A clock stepped back into that second: the next incident has an id of
    // its own all the same.
    w.now = opened.started_at.0;
    w.node.report = World::incident().node.report;
    if let Some(Ok(report)) = &mut w.node.report {
        report.observed_at = Time(w.now);
    }
    w.reconcile();
    assert_eq!(w.state.history[0].id, format!("{}-2", opened.id));
}

#[test]
fn a_budget_at_zero_holds_the_drain_and_says_so_by_name() {
    let mut w = World::incident();
    w.disruption_budgets = vec![BudgetView {
        name: "ml-serving/vllm".into(),
        allowed: 0,
        pods: w.pods.iter().map(|p| p.key()).collect(),
    }];
    w.run_until(
        |w| w.state.reason == Some(Reason::WaitingForDisruptionBudget),
        HOUR,
    );
    assert_eq!(w.state.phase, Phase::Draining);
    let message = w.state.message.clone().unwrap_or_default();
    assert!(
        message.contains("ml-serving/vllm: allows 0 disruption(s) now for pod ml-serving/vllm-7"),
        "{message}"
    );
    assert!(
        w.said.iter().any(|h| matches!(
            h,
            Happening::Entered {
                reason: Reason::WaitingForDisruptionBudget,
                ..
            }
        )),
        "an Event says so"
    );
    assert_eq!(
        w.count(|a| matches!(a, Action::RequestReset { .. })),
        0,
        "no reset while the pod holds the GPU"
    );
    // The budget allows one again: the drain goes on.
    w.disruption_budgets[0].allowed = 1;
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert!(
        w.evicted().iter().all(|p| p == "ml-serving/vllm-7"),
        "only the pod on GPU 7, asked again while refused"
    );
    assert!(!w.pods.iter().any(|p| p.name == "vllm-7"), "it left");
}

#[test]
fn a_drain_that_times_out_fails_the_node_naming_the_pods() {
    let mut w = World::incident();
    w.pods[7].tolerance = Ok(DisruptionTolerance::Never);
    w.run_until(|w| w.state.phase == Phase::Failed, HOUR);
    assert_eq!(w.state.reason, Some(Reason::DrainTimeout));
    assert!(
        w.state
            .message
            .clone()
            .unwrap_or_default()
            .contains("vllm-7")
    );
}

#[test]
fn dry_run_records_the_plan_and_touches_nothing() {
    let mut w = World::incident();
    w.spec.mode = Mode::DryRun;
    w.disruption_budgets = vec![
        BudgetView {
            name: "ml-serving/vllm".into(),
            allowed: 0,
            pods: w.pods.iter().map(|p| p.key()).collect(),
        },
        BudgetView {
            name: "ml-serving/other".into(),
            allowed: 1,
            pods: vec![PodKey::new("ml-serving", "vllm-1")],
        },
    ];
    for _ in 0..10 {
        let actions = w.reconcile();
        assert!(actions.is_empty(), "{actions:?}");
        w.advance(Duration::from_secs(60));
    }
    assert_eq!(w.state.phase, Phase::Suspect);
    assert!(
        w.said.iter().any(|h| matches!(
            h,
            Happening::Entered {
                phase: Phase::Suspect,
                reason: Reason::DryRun,
                ..
            }
        )),
        "{:?}",
        w.said
    );
    let plan = w.state.plan.clone().expect("a plan");
    assert!(plan.cordon);
    assert_eq!(plan.action, Some(RecoveryAction::GpuReset));
    assert_eq!(plan.gpus, [BAD_GPU]);
    assert_eq!(plan.evict, ["ml-serving/vllm-7"]);
    // Only budgets that cover a pod it would evict, with what they allow now.
    assert_eq!(
        plan.disruption_budgets,
        [
            "ml-serving/vllm: allows 0 disruption(s) now for pod ml-serving/vllm-7 to evict; each eviction would be refused (429) and retried until it allows one"
        ]
    );
    assert!(!w.node.unschedulable);
}

#[test]
fn a_busy_budget_and_an_open_circuit_hold_the_start() {
    let mut w = World::incident();
    w.budget.disruptive_elsewhere = 1;
    w.reconcile();
    assert_eq!(
        (w.state.phase, w.state.reason),
        (Phase::Suspect, Some(Reason::WaitingForBudget))
    );
    w.budget.disruptive_elsewhere = 0;
    w.budget.unhealthy = 9;
    w.reconcile();
    assert_eq!(w.state.reason, Some(Reason::CircuitOpen));
    assert!(!w.node.unschedulable);
    w.budget.unhealthy = 1;
    w.reconcile();
    assert_eq!(
        w.state.phase,
        Phase::Quarantined,
        "starts once the budget allows"
    );
}

#[test]
fn a_restarted_operator_reissues_the_same_request_never_a_second() {
    let mut w = World::incident();
    w.reset_agent = Agent::Silent;
    w.run_until(|w| w.state.phase == Phase::Remediating, HOUR);
    let id = w.node.reset_request.clone().expect("request on the node");
    let requested_at = w
        .state
        .action
        .as_ref()
        .and_then(|a| a.requested_at.clone())
        .expect("the attempt's time")
        .0;
    // The request annotation is lost (the write after the status write never
    // happened); a later reconcile re-issues the same request: same id, same
    // time, so that writing it twice changes nothing.
    w.node.reset_request = None;
    w.advance(Duration::from_secs(5));
    let actions = w.reconcile();
    assert_eq!(
        actions,
        [Action::RequestReset {
            id: id.clone(),
            gpus: vec![BAD_GPU.into()],
            requested_at,
        }]
    );
    // With the annotation there, nothing more is asked.
    assert!(w.reconcile().is_empty());
    w.reset_agent = Agent::Succeeds;
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert_eq!(
        w.executed.len(),
        1,
        "the agent carried out exactly one reset"
    );
    assert_eq!(w.executed[0], id);
    let mut ids: Vec<RequestId> = w
        .log
        .iter()
        .filter_map(|a| match a {
            Action::RequestReset { id, .. } => Some(id.clone()),
            _ => None,
        })
        .collect();
    ids.dedup();
    assert_eq!(
        ids,
        [id],
        "every request the engine made carried the same id"
    );
}

#[test]
fn a_second_attempt_uses_a_new_request_id() {
    let mut w = World::incident();
    w.spec.escalation = vec![EscalationStep {
        action: RecoveryAction::GpuReset,
        attempts: 2,
        timeout: None,
    }];
    w.reset_agent = Agent::Fails;
    w.run_until(|w| w.state.phase == Phase::Failed, HOUR);
    assert_eq!(w.executed.len(), 2);
    assert_ne!(w.executed[0], w.executed[1]);
    assert_eq!(
        w.state.history[0].attempts,
        [
            attempt(RecoveryAction::GpuReset, 1, AttemptOutcome::Failed),
            attempt(RecoveryAction::GpuReset, 2, AttemptOutcome::Failed)
        ]
    );
}

#[test]
fn a_wait_pod_is_waited_for() {
    let mut w = World::incident();
    w.pods[7].tolerance = Ok(DisruptionTolerance::Wait);
    w.run_until(|w| w.state.phase == Phase::Draining, HOUR);
    w.advance(Duration::from_secs(120));
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Draining);
    w.pods[7].finished = true;
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert!(w.evicted().is_empty());
    let _ = gpu_pod("unused", BAD_GPU);
}

#[test]
fn a_malformed_report_is_a_finding_and_an_event_never_an_action() {
    use gpuhealth_api::contract::{AnnotationValue, GpuReport};
    let mut w = World::incident();
    w.node.report = Some(GpuReport::parse("{not json"));
    let first = w.reconcile();
    assert!(first.is_empty(), "{first:?}");
    assert!(
        matches!(
            w.happenings.as_slice(),
            [Happening::Found {
                kind: FindingKind::MalformedGpuReport,
                ..
            }]
        ),
        "{:?}",
        w.happenings
    );
    assert_eq!(w.state.phase, Phase::Healthy);
    assert_eq!(w.state.findings[0].type_, FindingKind::MalformedGpuReport);
    // The same error again: nothing said a second time.
    assert!(w.reconcile().is_empty());
    assert!(w.happenings.is_empty(), "{:?}", w.happenings);
}

fn with_validation_pod() -> World {
    let mut w = World::incident();
    w.spec.verification.validation_pod = Some(ValidationPod {
        template: serde_json::json!({"spec": {"containers": [{"name": "dcgm", "image": "dcgm"}]}}),
        timeout: gpuhealth_api::Duration::from_secs(300),
    });
    w
}

fn validation_pods_created(w: &World) -> Vec<String> {
    w.log
        .iter()
        .filter_map(|a| match a {
            Action::CreateValidationPod { name } => Some(name.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn a_validation_pod_must_succeed_before_uncordon() {
    let mut w = with_validation_pod();
    w.run_until(|w| w.validation.is_some(), HOUR);
    assert_eq!(w.state.phase, Phase::Verifying);
    assert_eq!(w.state.reason, Some(Reason::Validating));
    assert!(w.node.unschedulable, "still cordoned while it runs");
    let name = validation_pods_created(&w)[0].clone();
    assert!(
        name.starts_with("gpuhealth-validate-192.168.1.1-inc-"),
        "{name}"
    );

    // Running: nothing more happens; no second pod.
    for _ in 0..3 {
        if let Some(v) = w.validation.as_mut() {
            v.phase = "Running".into();
        }
        w.reconcile();
        w.advance(Duration::from_secs(10));
    }
    assert_eq!(w.state.phase, Phase::Verifying);
    if let Some(v) = w.validation.as_mut() {
        v.phase = "Succeeded".into();
    }
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Healthy);
    assert!(!w.node.unschedulable);
    assert!(w.validation.is_none(), "a succeeded pod is cleaned up");
    assert_eq!(
        w.state.history[0].attempts,
        [
            attempt(RecoveryAction::GpuReset, 1, AttemptOutcome::Succeeded),
            attempt(AttemptAction::ValidationPod, 1, AttemptOutcome::Succeeded).saying(name)
        ]
    );
}

#[test]
fn a_failed_validation_pod_fails_the_attempt_and_escalates() {
    let mut w = with_validation_pod();
    w.run_until(|w| w.validation.is_some(), HOUR);
    if let Some(v) = w.validation.as_mut() {
        v.phase = "Failed".into();
        v.message = "dcgm: exit code 1".into();
    }
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Draining, "the next rung drains");
    assert_eq!(
        w.state.action.as_ref().map(|a| a.type_),
        Some(RecoveryAction::NodeReboot)
    );
    assert!(w.node.unschedulable);
    assert!(w.validation.is_some(), "a failed pod is kept for its logs");
    let history = &w.state.history[0].attempts;
    assert_eq!(history.len(), 2, "{history:?}");
    assert_eq!(
        history[0],
        attempt(RecoveryAction::GpuReset, 1, AttemptOutcome::Succeeded)
    );
    assert!(
        history[1].action == AttemptAction::ValidationPod
            && history[1].outcome == AttemptOutcome::Failed
            && history[1]
                .message
                .as_deref()
                .is_some_and(|pod| pod.ends_with("-reset-1")),
        "{history:?}"
    );
    let failed = w.said.iter().any(
        |h| matches!(h, Happening::AttemptFailed { why } if why.contains("dcgm: exit code 1")),
    );
    assert!(failed, "{:?}", w.said);
}

#[test]
fn a_validation_pod_that_never_appears_times_out() {
    let mut w = with_validation_pod();
    w.refuse_validation_pod = true;
    w.spec.escalation.truncate(1);
    w.run_until(|w| w.state.phase == Phase::Failed, HOUR);
    assert!(w.node.unschedulable, "a failed node stays cordoned");
    assert!(
        w.state.history[0].attempts.iter().any(|a| {
            a.action == AttemptAction::ValidationPod && a.outcome == AttemptOutcome::TimedOut
        }),
        "{:?}",
        w.state.history[0].attempts
    );
}

#[test]
fn a_pod_on_the_bad_gpu_gets_a_finding_and_an_event_once() {
    let mut w = World::incident();
    w.reconcile();
    let about_pods: Vec<&Option<PodKey>> = w
        .happenings
        .iter()
        .filter_map(|h| match h {
            Happening::Found {
                kind: FindingKind::PodOnBadGpu,
                pod,
                ..
            } => Some(pod),
            _ => None,
        })
        .collect();
    let holder = w.state.gpus[7].pods.clone();
    assert_eq!(holder.len(), 1);
    assert_eq!(
        about_pods,
        [&Some(holder[0].clone())],
        "said once, of that pod"
    );
    let finding = w
        .state
        .findings
        .iter()
        .find(|f| f.type_ == FindingKind::PodOnBadGpu)
        .expect("a finding");
    assert_eq!(
        finding.subject,
        Some(gpuhealth_api::vocabulary::FindingSubject::Pod(
            holder[0].clone()
        ))
    );
    assert!(finding.message.contains(BAD_GPU), "{}", finding.message);
    w.reconcile();
    assert!(
        !w.happenings.iter().any(|h| matches!(
            h,
            Happening::Found {
                kind: FindingKind::PodOnBadGpu,
                ..
            }
        )),
        "not repeated: {:?}",
        w.happenings
    );
}

/// The agent's clock an hour off the operator's, either way: its report,
/// its Xids and its answers are stamped by it.
fn skewed(by: SignedDuration) -> World {
    let mut w = World::incident();
    w.agent_clock = by;
    if let Some(Ok(report)) = &mut w.node.report {
        report.observed_at = Time(report.observed_at.0.saturating_add(by).expect("time"));
        for g in &mut report.gpus {
            for x in &mut g.xids {
                x.at = Time(x.at.0.saturating_add(by).expect("time"));
            }
        }
    }
    w
}

#[test]
fn an_agent_clock_an_hour_ahead_gets_one_remediation_and_no_repeat() {
    let mut w = skewed(SignedDuration::from_hours(1));
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    // The reset answered, the agent forgets the Xids it answered (as the
    // real one does); hours of reconciles after that change nothing.
    w.clear();
    w.run_until(|w| w.now > ts("2026-05-29T11:00:00Z"), 3 * HOUR);
    assert_eq!(w.state.phase, Phase::Healthy);
    assert_eq!(w.executed.len(), 1, "{:?}", w.executed);
    assert_eq!(w.state.history.len(), 1, "one incident");
}

#[test]
fn an_agent_clock_an_hour_behind_still_verifies_the_reset() {
    let mut w = skewed(SignedDuration::from_hours(-1));
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert_eq!(w.executed.len(), 1, "{:?}", w.executed);
    assert_eq!(w.state.history[0].outcome, Some(IncidentOutcome::Recovered));
}
