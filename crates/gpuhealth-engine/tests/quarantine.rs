//! Per-GPU quarantine, with no server: a DRA node's bad GPU is fenced by a
//! `DeviceTaintRule` of its own and the node keeps serving; a step that
//! takes the node down widens the fence to a cordon; a device plugin's
//! withdrawal is a fence only while it is exact; and the rules always end
//! up as the status records them, wherever the operator stopped.

mod common;

use std::time::Duration;

use common::{Agent, BAD_GPU, World};
use gpuhealth_api::{
    node_health::Phase,
    policy::{DrainScope, Mode},
    quarantine::{Fenced, GpuFence, QuarantineScope},
    vocabulary::{FindingKind, IncidentOutcome, QuarantineWhy},
};
use gpuhealth_engine::{
    fence::{ResourceCount, RuleView},
    happening::Happening,
    machine::Action,
};

const HOUR: Duration = Duration::from_secs(3600);
const GPU_7_RULE_SUFFIX: &str = "-gpu-7";

fn cordons(w: &World) -> usize {
    w.count(|a| matches!(a, Action::Cordon { .. }))
}

#[test]
fn a_bad_gpu_on_a_dra_node_is_fenced_alone_and_the_node_keeps_serving() {
    let mut w = World::incident().with_dra();
    let first = w.reconcile();
    assert_eq!(w.state.phase, Phase::Quarantined);
    assert!(
        matches!(first.first(), Some(Action::TaintDevice { device, .. }) if device.device == "gpu-7"),
        "the fence is the first action: {first:?}"
    );
    let q = w.state.quarantine.clone().expect("recorded");
    assert_eq!((q.scope, q.why), (Fenced::Gpu, QuarantineWhy::GpusFenced));
    assert_eq!(q.gpus.len(), 1);
    assert_eq!(q.gpus[0].uuid, BAD_GPU);
    assert_eq!(q.gpus[0].fence, GpuFence::DeviceTaintRule);
    let message = w.state.message.clone().unwrap_or_default();
    assert!(
        message.starts_with("GPU 7 fenced by DeviceTaintRule"),
        "{message}"
    );
    assert!(
        w.said
            .iter()
            .any(|h| matches!(h, Happening::QuarantinedForReport { .. })),
        "the fence counts as the quarantine"
    );

    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert_eq!(cordons(&w), 0, "never cordoned");
    assert!(!w.node.unschedulable);
    assert_eq!(w.evicted(), ["ml-serving/vllm-7"], "only GPU 7's holder");
    assert_eq!(w.reset_requests(), [vec![BAD_GPU.to_owned()]]);
    assert_eq!(
        w.count(|a| matches!(a, Action::TaintDevice { .. })),
        1,
        "one rule, written once"
    );
    assert!(w.rules().is_empty(), "the rule is gone: {:?}", w.rules());
    w.reconcile();
    assert_eq!(w.state.quarantine, None, "forgotten once its rule is gone");
    assert_eq!(w.state.history[0].outcome, Some(IncidentOutcome::Recovered));
    let kept = w.said.iter().find_map(|h| match h {
        Happening::GpuFenceEnded {
            fenced, serving, ..
        } => Some((*fenced, *serving)),
        _ => None,
    });
    assert_eq!(kept, Some((1, 7)), "seven GPUs served throughout");
}

#[test]
fn a_reboot_widens_the_fence_to_a_cordon_and_says_why() {
    let mut w = World::incident().with_dra();
    w.reset_agent = Agent::Fails;
    w.run_until(
        |w| {
            w.state
                .action
                .as_ref()
                .is_some_and(|a| a.type_ >= gpuhealth_api::RecoveryAction::NodeReboot)
        },
        HOUR,
    );
    let q = w.state.quarantine.clone().expect("recorded");
    assert_eq!(
        (q.scope, q.why),
        (Fenced::Node, QuarantineWhy::StepTakesTheNode)
    );
    assert_eq!(q.gpus.len(), 1, "GPU 7's fence stays until the end");
    w.reconcile();
    assert!(w.node.unschedulable, "cordoned for the reboot");
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert!(!w.node.unschedulable, "uncordoned after");
    w.reconcile();
    assert!(w.rules().is_empty(), "{:?}", w.rules());
    assert_eq!(w.state.quarantine, None);
}

#[test]
fn without_a_fence_for_the_gpu_the_node_is_cordoned_and_a_gpu_policy_hears_why() {
    // No DRA device names GPU 7, and no device plugin withdrew it.
    let mut w = World::incident();
    w.spec.quarantine.scope = QuarantineScope::Gpu;
    w.reconcile();
    assert!(w.node.unschedulable);
    let q = w.state.quarantine.clone().expect("recorded");
    assert_eq!(
        (q.scope, q.why),
        (Fenced::Node, QuarantineWhy::NoDeviceFence)
    );
    assert!(
        w.state
            .findings
            .iter()
            .any(|f| f.type_ == FindingKind::NodeQuarantinedInstead),
        "{:?}",
        w.state.findings
    );

    // Auto says nothing: cordoning is what it chose.
    let mut w = World::incident();
    w.reconcile();
    assert!(w.node.unschedulable);
    assert!(
        w.state
            .findings
            .iter()
            .all(|f| f.type_ != FindingKind::NodeQuarantinedInstead)
    );
}

#[test]
fn auto_cordons_when_the_drain_takes_more_than_the_gpus_holders() {
    let mut w = World::incident().with_dra();
    w.spec.drain.scope = DrainScope::GpuPods;
    w.reconcile();
    assert!(w.node.unschedulable);
    assert_eq!(
        w.state.quarantine.as_ref().map(|q| q.why),
        Some(QuarantineWhy::DrainTakesMore)
    );
}

#[test]
fn a_device_plugin_fence_holds_only_while_it_withdraws_exactly_the_bad_gpu() {
    let mut w = World::incident();
    w.node.gpu_resource = Some(ResourceCount {
        capacity: 8,
        allocatable: 7,
    });
    w.reconcile();
    assert!(
        !w.node.unschedulable,
        "the plugin's withdrawal is the fence"
    );
    let q = w.state.quarantine.clone().expect("recorded");
    assert_eq!(q.scope, Fenced::Gpu);
    assert_eq!(q.gpus[0].fence, GpuFence::DevicePlugin);

    // The plugin offers GPU 7 again while it is still bad: cordon.
    w.node.gpu_resource = Some(ResourceCount {
        capacity: 8,
        allocatable: 8,
    });
    w.reconcile();
    assert!(w.node.unschedulable, "a bad GPU is never left schedulable");
    let q = w.state.quarantine.clone().expect("recorded");
    assert_eq!(
        (q.scope, q.why),
        (Fenced::Node, QuarantineWhy::DevicePluginOffersBadGpu)
    );
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    assert!(!w.node.unschedulable, "uncordoned after recovery");

    // The count is right, but the report says the kubelet still offers
    // GPU 7: another GPU is the one withdrawn. Cordoned.
    let mut w = World::incident();
    w.node.gpu_resource = Some(ResourceCount {
        capacity: 8,
        allocatable: 7,
    });
    if let Some(Ok(report)) = &mut w.node.report {
        for g in &mut report.gpus {
            g.offered = Some(g.index == 7);
        }
    }
    w.reconcile();
    assert!(w.node.unschedulable, "the count alone is no fence");
    let q = w.state.quarantine.clone().expect("recorded");
    assert_eq!(q.why, QuarantineWhy::NoDeviceFence);
    assert!(q.message.contains("still offers GPU 7"), "{}", q.message);
}

#[test]
fn rules_end_as_the_status_records_them_wherever_the_operator_stopped() {
    // Recorded, then stopped before the rule was written: written now.
    let mut w = World::incident().with_dra();
    w.reconcile();
    let rule = w.rules().pop().expect("written");
    assert!(rule.ends_with(GPU_7_RULE_SUFFIX), "{rule}");
    w.node.dra.as_mut().expect("dra").rules.clear();
    let again = w.reconcile();
    assert!(
        again
            .iter()
            .any(|a| matches!(a, Action::TaintDevice { rule: r, .. } if *r == rule)),
        "{again:?}"
    );

    // A rule of ours no record names (written by a decision whose status
    // never landed, or left by an earlier incident): deleted.
    let mut w = World::incident().with_dra();
    w.clear();
    w.node.dra.as_mut().expect("dra").rules.push(RuleView {
        name: "gpuhealth-inc-1-ab-gpu-7".into(),
        incident: "inc-1-ab".into(),
        created: None,
    });
    let actions = w.reconcile();
    assert_eq!(
        actions,
        [Action::UntaintDevice {
            rule: "gpuhealth-inc-1-ab-gpu-7".into()
        }]
    );
    assert!(w.rules().is_empty());

    // Recovered, then stopped after the rule was deleted and before that
    // was recorded: the record goes, nothing else is done.
    let mut w = World::incident().with_dra();
    w.run_until(|w| w.state.phase == Phase::Healthy, HOUR);
    // The recovering step recorded the lift and deleted the rule; the
    // record is still there, as after a kill before the next step.
    let lifted = w
        .state
        .quarantine
        .clone()
        .expect("kept until its rule is seen gone");
    assert!(lifted.lifted_at.is_some(), "{lifted:?}");
    assert!(w.rules().is_empty());
    let actions = w.reconcile();
    assert!(actions.is_empty(), "{actions:?}");
    assert_eq!(w.state.quarantine, None);
}

#[test]
fn a_dry_run_plan_says_what_it_would_fence() {
    let mut w = World::incident().with_dra();
    w.spec.mode = Mode::DryRun;
    let actions = w.reconcile();
    assert!(actions.is_empty(), "{actions:?}");
    let plan = w.state.plan.clone().expect("a plan");
    assert!(!plan.cordon, "it would not cordon");
    let q = plan.quarantine.expect("what it would fence");
    assert_eq!(q.scope, Fenced::Gpu);
    assert!(q.message.starts_with("GPU 7 fenced"), "{}", q.message);
    assert!(w.rules().is_empty());
}
