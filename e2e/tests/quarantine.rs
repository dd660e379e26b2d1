//! Per-GPU quarantine on the real API server: KWOK GPU nodes whose GPUs a
//! simulated DRA driver publishes in ResourceSlices, pods whose
//! ResourceClaims the real scheduler allocates, the operator binary and the
//! fake agent. One broken GPU costs one GPU: the node keeps taking work,
//! and the scheduler itself keeps new claims off the fenced device. A Node
//! deleted mid-reset leaves its incident Failed, its fence down.
//!
//! Long because each test is one whole story of a fence, short on its own,
//! and they share the helpers that read claims and rules.

use std::sync::atomic::Ordering;

use gpuhealth_api::{
    GpuHealth, RecoveryAction,
    device_taint_rule::{DeviceTaintRule, RuleVersion},
    node_health::Phase,
    quarantine::{DEVICE_TAINT_KEY, Fenced, GpuFence, RULE_NODE_LABEL},
    vocabulary::{FindingKind, IncidentOutcome, QuarantineWhy, Reason},
};
use gpuhealth_e2e::{
    agent::Answer,
    dra,
    operator::{self, Options},
    reports,
    scenario::{Scenario, WAIT},
    sim::{is_cordoned, watch_cordon},
    wait::{until, until_set},
};
use k8s_openapi::{
    api::core::v1::{Node, Pod, ResourceHealth, ResourceStatus},
    apimachinery::pkg::util::intstr::IntOrString,
};
use kube::{
    Api, Client,
    api::{ListParams, Patch, PatchParams},
    runtime::watcher,
};
use serde_json::json;

fn hold(answer: &std::sync::Mutex<Answer>) {
    if let Ok(mut a) = answer.lock() {
        *a = Answer::Hold;
    }
}

/// A pod `holder-<i>` claiming GPU `i`, for each of `gpus`, each allocated
/// that GPU by the scheduler.
async fn holders(s: &Scenario, gpus: &[u32]) {
    for &i in gpus {
        dra::claiming_pod(
            &s.client,
            &s.namespace,
            &s.group,
            &format!("holder-{i}"),
            Some(i),
        )
        .await
        .expect("a pod claiming one GPU");
    }
    for &i in gpus {
        assert_eq!(
            dra::device_of(&s.client, &s.namespace, &format!("holder-{i}"))
                .await
                .expect("a claim allocated"),
            dra::device_name(i)
        );
    }
}

/// Waits until no rule of gpuhealth's is left for `node`, then until its
/// status has forgotten the fence: no rule outlives its incident.
async fn fence_gone(s: &Scenario, node: &str) {
    until_set(
        dra::rules(&s.client).await.expect("rules"),
        watcher::Config::default().labels(&format!("{RULE_NODE_LABEL}={node}")),
        "gpuhealth's rules gone",
        WAIT,
        |set| set.is_empty(),
    )
    .await
    .expect("no rule outlives its incident");
    s.wait_status(node, "the fence's record gone", |st| {
        st.quarantine.is_none()
    })
    .await
    .expect("forgotten");
}

/// gpuhealth's DeviceTaintRules for `node`.
async fn rules_of(client: &Client, node: &str) -> Vec<DeviceTaintRule> {
    dra::rules(client)
        .await
        .expect("rules")
        .list(&ListParams::default().labels(&format!("{RULE_NODE_LABEL}={node}")))
        .await
        .expect("list DeviceTaintRules")
        .items
}

#[tokio::test]
async fn a_bad_gpu_on_a_dra_node_costs_that_gpu_and_the_node_keeps_serving() {
    let mut s = Scenario::new_dra("dra-gpu", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    // Every GPU held but GPU 6; GPU 7's holder is the one to go.
    let held = [0, 1, 2, 3, 4, 5, 7];
    holders(&s, &held).await;
    hold(&s.agent.reset);
    s.start().await.expect("operator and agent");
    let (watch, ever_cordoned) = watch_cordon(&s.client, &node);

    // GPU 7 fails. The report names no holder: the claims say who it is.
    let mut report = reports::healthy(&s.namespace, &[]);
    reports::xid_119_and_154(&mut report, 7);
    s.write_report(&node, report).await.expect("report");

    let status = s
        .wait_status(&node, "GPU 7 fenced and its reset asked for", |st| {
            st.phase == Phase::Remediating && st.quarantine.as_ref().is_some_and(|q| q.per_gpu())
        })
        .await
        .expect("fenced");
    let q = status.quarantine.expect("recorded");
    assert_eq!((q.scope, q.why), (Fenced::Gpu, QuarantineWhy::GpusFenced));
    assert_eq!(q.gpus.len(), 1);
    assert_eq!(q.gpus[0].fence, GpuFence::DeviceTaintRule);
    assert_eq!(q.gpus[0].index, Some(7));
    let rules = rules_of(&s.client, &node).await;
    assert_eq!(rules.len(), 1, "one rule: {rules:?}");
    let selector = rules[0].spec.device_selector.clone().expect("a selector");
    assert_eq!(selector.driver.as_deref(), Some(dra::DRIVER));
    assert_eq!(selector.pool.as_deref(), Some(node.as_str()));
    assert_eq!(selector.device.as_deref(), Some("gpu-7"));
    assert_eq!(rules[0].spec.taint.key, DEVICE_TAINT_KEY);
    assert_eq!(rules[0].spec.taint.effect, "NoSchedule");
    // In the newest version the cluster serves: v1 from 1.37, v1beta2 on
    // 1.36 (the local cluster turns its gate on); the operator said which.
    let minor = s.client.apiserver_version().await.expect("version").minor;
    let minor: u32 = minor.trim_end_matches('+').parse().expect("a minor");
    let newest = if minor >= 37 {
        RuleVersion::V1
    } else {
        RuleVersion::V1beta2
    };
    assert_eq!(dra::rule_version(&s.client).await.expect("served"), newest);
    let log =
        std::fs::read_to_string(&s.operator.as_ref().expect("operator").log).unwrap_or_default();
    assert!(
        log.lines()
            .any(|line| line.contains("serves DeviceTaintRules")
                && line.ends_with(&format!("version={newest}"))),
        "the operator says it fences in {newest}:\n{log}"
    );

    // Only GPU 7's holder was evicted.
    let pods: Api<Pod> = Api::namespaced(s.client.clone(), &s.namespace);
    let left = until_set(
        pods.clone(),
        watcher::Config::default(),
        "GPU 7's holder gone",
        WAIT,
        |set| !set.contains_key("holder-7"),
    )
    .await
    .expect("holder-7 evicted");
    let mut left: Vec<&String> = left.keys().collect();
    left.sort();
    assert_eq!(
        left,
        [
            "holder-0", "holder-1", "holder-2", "holder-3", "holder-4", "holder-5"
        ]
    );

    // While GPU 7 is fenced, a new one-GPU claim lands on the same node, on
    // the one device left: GPU 7 is free but tainted, so the scheduler
    // passes it over.
    dra::claiming_pod(&s.client, &s.namespace, &s.group, "newcomer", None)
        .await
        .expect("a new pod");
    assert_eq!(
        dra::device_of(&s.client, &s.namespace, "newcomer")
            .await
            .expect("a claim allocated"),
        "gpu-6",
        "never GPU 7"
    );
    until(pods.clone(), "newcomer", WAIT, |p| {
        p.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(node.as_str())
    })
    .await
    .expect("scheduled onto the node");

    s.agent
        .release(&s.client, &node)
        .await
        .expect("the reset goes ahead");
    let recovered = s.wait_recovered(&node).await.expect("recovered");
    assert!(
        recovered.history[0].trigger.contains("GPU 7"),
        "{}",
        recovered.history[0].trigger
    );
    fence_gone(&s, &node).await;

    // GPU 7 is allocatable again.
    dra::claiming_pod(&s.client, &s.namespace, &s.group, "late", None)
        .await
        .expect("a later pod");
    assert_eq!(
        dra::device_of(&s.client, &s.namespace, "late")
            .await
            .expect("a claim allocated"),
        "gpu-7"
    );
    drop(watch);
    assert!(
        !ever_cordoned.load(Ordering::SeqCst),
        "the node was never cordoned"
    );
}

/// The kubelet's word, written as it would: `device` of the pod's claim
/// `gpu` is Unhealthy.
async fn kubelet_says_unhealthy(s: &Scenario, pod: &str, device: &str) {
    let pods: Api<Pod> = Api::namespaced(s.client.clone(), &s.namespace);
    let running = until(pods.clone(), pod, WAIT, |p| {
        p.status
            .as_ref()
            .and_then(|st| st.container_statuses.as_ref())
            .is_some_and(|c| !c.is_empty())
    })
    .await
    .expect("the pod runs");
    let mut statuses = running
        .status
        .and_then(|st| st.container_statuses)
        .unwrap_or_default();
    statuses[0].allocated_resources_status = Some(vec![ResourceStatus {
        name: "claim:gpu".into(),
        resources: Some(vec![ResourceHealth {
            resource_id: device.into(),
            health: Some("Unhealthy".into()),
            message: Some("Xid 48: double-bit ECC error".into()),
        }]),
    }]);
    pods.patch_status(
        pod,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"containerStatuses": statuses}})),
    )
    .await
    .expect("the kubelet's status written");
}

#[tokio::test]
async fn a_gpu_the_kubelet_calls_unhealthy_in_a_pods_status_is_fenced_alone() {
    let mut s = Scenario::new_dra("dra-kubelet", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    holders(&s, &[2, 3]).await;
    hold(&s.agent.reset);
    s.start().await.expect("operator and agent");
    let (watch, ever_cordoned) = watch_cordon(&s.client, &node);

    // The report says every GPU is well; the kubelet says GPU 3 is not.
    let device = format!("{}/{node}/{}", dra::DRIVER, dra::device_name(3));
    kubelet_says_unhealthy(&s, "holder-3", &device).await;
    let status = s
        .wait_status(&node, "GPU 3 fenced on the kubelet's word", |st| {
            st.phase == Phase::Remediating && st.quarantine.as_ref().is_some_and(|q| q.per_gpu())
        })
        .await
        .expect("fenced");
    let q = status.quarantine.expect("recorded");
    assert_eq!(q.gpus.len(), 1);
    assert_eq!(q.gpus[0].index, Some(3));
    let opened = &status.history[0].signals;
    assert_eq!(opened.len(), 1, "{opened:?}");
    assert_eq!(opened[0].reason, Reason::DeviceUnhealthy);
    assert_eq!(opened[0].gpu.as_ref(), Some(&q.gpus[0].uuid));
    assert!(
        opened[0]
            .message
            .contains(&format!("{}/holder-3 Unhealthy", s.namespace))
            && opened[0].message.contains("double-bit ECC"),
        "{}",
        opened[0].message
    );

    // Its holder goes; the other stays.
    let pods: Api<Pod> = Api::namespaced(s.client.clone(), &s.namespace);
    let left = until_set(
        pods.clone(),
        watcher::Config::default(),
        "GPU 3's holder gone",
        WAIT,
        |set| !set.contains_key("holder-3"),
    )
    .await
    .expect("holder-3 evicted");
    assert!(left.contains_key("holder-2"));

    s.agent
        .release(&s.client, &node)
        .await
        .expect("the reset goes ahead");
    let recovered = s.wait_recovered(&node).await.expect("recovered");
    assert!(
        recovered.history[0].trigger.contains("kubelet"),
        "{}",
        recovered.history[0].trigger
    );
    fence_gone(&s, &node).await;
    drop(watch);
    assert!(
        !ever_cordoned.load(Ordering::SeqCst),
        "the node was never cordoned"
    );
}

#[tokio::test]
async fn a_reboot_class_failure_on_a_dra_node_cordons_it_and_says_why() {
    let mut s = Scenario::new_dra("dra-reboot", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    dra::claiming_pod(&s.client, &s.namespace, &s.group, "holder-7", Some(7))
        .await
        .expect("a pod");
    dra::device_of(&s.client, &s.namespace, "holder-7")
        .await
        .expect("a claim allocated");
    hold(&s.agent.reboot);
    s.start().await.expect("operator and agent");

    let mut report = reports::healthy(&s.namespace, &[]);
    report.gpus[7].health = GpuHealth::RebootRequired;
    s.write_report(&node, report).await.expect("report");
    let status = s
        .wait_status(&node, "the node cordoned for a reboot", |st| {
            st.phase == Phase::Remediating
        })
        .await
        .expect("remediating");
    let q = status.quarantine.expect("recorded");
    assert_eq!(
        (q.scope, q.why),
        (Fenced::Node, QuarantineWhy::StepTakesTheNode)
    );
    assert!(
        q.message
            .contains(&format!("{:?}", RecoveryAction::NodeReboot)),
        "{}",
        q.message
    );
    assert!(is_cordoned(&s.node(&node).await.expect("node")));
    assert!(
        rules_of(&s.client, &node).await.is_empty(),
        "no device fence for a reboot"
    );

    s.agent
        .release(&s.client, &node)
        .await
        .expect("the reboot goes ahead");
    s.wait_recovered(&node).await.expect("recovered");
    assert!(!is_cordoned(&s.node(&node).await.expect("node")));
}

#[tokio::test]
async fn a_device_plugin_node_stays_schedulable_only_while_the_plugin_withdrew_the_bad_gpu() {
    let mut spec = Scenario::quick_spec();
    spec.max_concurrent = IntOrString::Int(2);
    spec.max_unhealthy = IntOrString::String("100%".into());
    let mut s = Scenario::new("plugin-fence", 2, spec)
        .await
        .expect("scenario");
    let (withdrawn, offered) = (s.nodes[0].clone(), s.nodes[1].clone());
    hold(&s.agent.reset);
    s.start().await.expect("operator and agent");
    let (watch, ever_cordoned) = watch_cordon(&s.client, &withdrawn);

    // The device plugin withdrew GPU 7 on one node and not on the other.
    let status = json!({"status": {"allocatable": {"nvidia.com/gpu": "7"}}});
    Api::<Node>::all(s.client.clone())
        .patch_status(&withdrawn, &PatchParams::default(), &Patch::Merge(status))
        .await
        .expect("allocatable 7");
    for node in [&withdrawn, &offered] {
        s.break_gpu(node, 7).await.expect("GPU 7 breaks");
    }

    let st = s
        .wait_status(&withdrawn, "fenced by the device plugin", |st| {
            st.phase == Phase::Remediating
        })
        .await
        .expect("remediating");
    let q = st.quarantine.expect("recorded");
    assert_eq!(q.scope, Fenced::Gpu, "{q:?}");
    assert_eq!(q.gpus[0].fence, GpuFence::DevicePlugin);
    let st = s
        .wait_status(&offered, "cordoned", |st| st.phase == Phase::Remediating)
        .await
        .expect("remediating");
    let q = st.quarantine.expect("recorded");
    assert_eq!(
        (q.scope, q.why),
        (Fenced::Node, QuarantineWhy::NoDeviceFence)
    );
    assert!(q.message.contains("offers 8 of 8"), "{}", q.message);
    assert!(is_cordoned(&s.node(&offered).await.expect("node")));

    for node in [&withdrawn, &offered] {
        s.agent
            .release(&s.client, node)
            .await
            .expect("resets go ahead");
    }
    for node in [&withdrawn, &offered] {
        s.wait_recovered(node).await.expect("recovered");
    }
    drop(watch);
    assert!(!ever_cordoned.load(Ordering::SeqCst), "never cordoned");
}

#[tokio::test]
async fn an_operator_killed_around_a_fence_leaves_no_rule_behind_and_no_gpu_fenced_forever() {
    // Killed after writing the rule and recording it, before the rest of
    // the step's actions; after those, before the next step saw the rule;
    // after recording the recovery and before deleting the rule; after
    // deleting it, before the next step recorded that. (Between the rule
    // and its record: the chaos run's `fence_kills`.)
    let crashes = [
        (Phase::Quarantined, ""),
        (Phase::Quarantined, "+acted"),
        (Phase::Healthy, ""),
        (Phase::Healthy, "+acted"),
    ];
    let mut spec = Scenario::quick_spec();
    spec.remediation_limits.per_gpu = 0;
    spec.remediation_limits.per_node = 0;
    spec.remediation_limits.cooldown = gpuhealth_api::Duration::from_secs(0);
    let mut s = Scenario::new_dra("dra-crash", 1, spec)
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    s.start_agent();
    for (i, (phase, moment)) in crashes.into_iter().enumerate() {
        let gpu = 4 + i;
        let holder = format!("holder-{gpu}");
        dra::claiming_pod(&s.client, &s.namespace, &s.group, &holder, Some(gpu as u32))
            .await
            .expect("a pod");
        dra::device_of(&s.client, &s.namespace, &holder)
            .await
            .expect("a claim allocated");
        let lease = format!("{}-{i}", s.group);
        let mut first = operator::start_with(
            &format!("{lease}-crashes"),
            Options {
                lease: Some(lease.clone()),
                crash_after: Some(format!("{phase:?}{moment}:{node}")),
                ..Default::default()
            },
        )
        .await
        .expect("operator");
        s.wait_taken_in().await.expect("taken in");
        let mut report = reports::healthy(&s.namespace, &[]);
        reports::xid_119_and_154(&mut report, gpu);
        s.write_report(&node, report).await.expect("report");
        let exit = first.exited(WAIT).await.expect("the crash");
        assert_eq!(exit.code(), Some(3), "crashed through the test hook");
        let at_crash = s
            .wait_status(&node, "the recorded intent", |_| true)
            .await
            .expect("status");
        assert_eq!(at_crash.phase, phase, "crashed entering {phase:?}{moment}");

        let mut second = operator::start_with(
            &format!("{lease}-resumes"),
            Options {
                lease: Some(lease),
                ..Default::default()
            },
        )
        .await
        .expect("operator");
        // A replica killed as it recorded the recovery never told it in an
        // Event (Events follow the actions): the status says it.
        let status = s
            .wait_status(&node, "recovered", |st| {
                st.phase == Phase::Healthy
                    && st.history.first().is_some_and(|i| {
                        i.outcome == Some(IncidentOutcome::Recovered)
                            && i.trigger.contains(&format!("GPU {gpu} "))
                    })
            })
            .await
            .expect("recovers");
        assert!(
            status.history[0].trigger.contains(&format!("GPU {gpu}")),
            "{}",
            status.history[0].trigger
        );
        fence_gone(&s, &node).await;
        assert!(
            !is_cordoned(&s.node(&node).await.expect("node")),
            "never cordoned"
        );
        // The GPU takes new work again.
        let late = format!("late-{gpu}");
        dra::claiming_pod(&s.client, &s.namespace, &s.group, &late, Some(gpu as u32))
            .await
            .expect("a later pod");
        assert_eq!(
            dra::device_of(&s.client, &s.namespace, &late)
                .await
                .expect("a claim allocated"),
            dra::device_name(gpu as u32)
        );
        second.kill().await;
        eprintln!("killed entering {phase:?}{moment}: no rule left, GPU {gpu} allocatable");
    }
}

/// A rule that goes missing mid-incident (deleted by an identity allowed
/// to) leaves a gap before the operator writes it again, and the real
/// scheduler gives the bad device to a pending pod inside it. That pod is
/// drained like the first holder, while the reset is still in flight.
#[tokio::test]
async fn a_pod_given_the_fenced_gpu_while_its_rule_was_gone_is_drained() {
    let mut s = Scenario::new_dra("dra-gap", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    holders(&s, &[0, 1, 2, 3, 4, 5, 6, 7]).await;
    hold(&s.agent.reset);
    s.start().await.expect("operator and agent");
    let mut report = reports::healthy(&s.namespace, &[]);
    reports::xid_119_and_154(&mut report, 7);
    s.write_report(&node, report).await.expect("report");
    s.wait_status(&node, "GPU 7 fenced and its reset asked for", |st| {
        st.phase == Phase::Remediating && st.quarantine.as_ref().is_some_and(|q| q.per_gpu())
    })
    .await
    .expect("fenced");
    let pods: Api<Pod> = Api::namespaced(s.client.clone(), &s.namespace);
    until_set(
        pods.clone(),
        watcher::Config::default(),
        "GPU 7's holder gone",
        WAIT,
        |set| !set.contains_key("holder-7"),
    )
    .await
    .expect("holder-7 evicted");

    // The rule deleted (the test's identity may: it holds break glass).
    // The operator writes it again within about 100 ms of seeing it gone,
    // a gap the scheduler hits only by luck: here the operator is held
    // (SIGSTOP, as a slow or cut-off one would be) while a pod that can
    // only have GPU 7 arrives and the scheduler allocates it the device.
    let operator = s.operator.as_ref().expect("the operator runs");
    operator.stall().await.expect("the operator stalled");
    dra::delete_fences(&s.client, &node)
        .await
        .expect("the rule deleted");
    dra::claiming_pod(&s.client, &s.namespace, &s.group, "newcomer", Some(7))
        .await
        .expect("a pod wanting GPU 7");
    let given = dra::device_of(&s.client, &s.namespace, "newcomer")
        .await
        .expect("a claim allocated");
    operator.resume().await.expect("the operator going on");
    assert_eq!(given, "gpu-7");
    // Drained while the reset is still held: no pod on GPU 7 when it runs.
    until_set(
        pods.clone(),
        watcher::Config::default(),
        "the newcomer on GPU 7 gone",
        WAIT,
        |set| !set.contains_key("newcomer"),
    )
    .await
    .expect("the newcomer evicted before the reset");
    assert!(
        !rules_of(&s.client, &node).await.is_empty(),
        "the rule written again"
    );
    s.agent
        .release(&s.client, &node)
        .await
        .expect("the reset goes ahead");
    s.wait_recovered(&node).await.expect("recovered");
    fence_gone(&s, &node).await;
}

/// Deleting a Node takes its requests with it. With a reset in flight the
/// incident is not silently done: its record stays `Failed` with reason
/// `NodeDeleted` and a finding, the attempt abandoned, and gpuhealth's
/// fence on the gone GPU comes down. A node with nothing under way just
/// goes, record and all.
#[tokio::test]
async fn a_node_deleted_mid_reset_leaves_its_incident_failed_and_said() {
    let mut s = Scenario::new_dra("dra-deleted", 2, Scenario::quick_spec())
        .await
        .expect("scenario");
    let (node, quiet) = (s.nodes[0].clone(), s.nodes[1].clone());
    hold(&s.agent.reset);
    s.start().await.expect("operator and agent");
    let mut report = reports::healthy(&s.namespace, &[]);
    reports::xid_119_and_154(&mut report, 7);
    s.write_report(&node, report).await.expect("report");
    let status = s
        .wait_status(&node, "GPU 7 fenced and its reset asked for", |st| {
            st.phase == Phase::Remediating
                && st.action.as_ref().is_some_and(|a| a.requested_at.is_some())
        })
        .await
        .expect("reset requested");
    let attempt = status.action.expect("the attempt");
    assert_eq!(rules_of(&s.client, &node).await.len(), 1);
    s.wait_status(&quiet, "the quiet node recorded", |st| {
        st.phase == Phase::Healthy
    })
    .await
    .expect("a record for the quiet node");

    let nodes: Api<Node> = Api::all(s.client.clone());
    for n in [&node, &quiet] {
        nodes
            .delete(n, &Default::default())
            .await
            .expect("the Node deleted");
    }

    let failed = s
        .wait_status(&node, "Failed with its node", |st| {
            st.phase == Phase::Failed && st.reason == Some(Reason::NodeDeleted)
        })
        .await
        .expect("the incident fails with its node");
    let finding = failed
        .findings
        .iter()
        .find(|f| f.type_ == FindingKind::NodeDeleted)
        .expect("a NodeDeleted finding");
    assert!(
        finding.message.contains(attempt.id.as_str()) && finding.message.contains("abandoned"),
        "{}",
        finding.message
    );
    assert_eq!(
        failed.history[0].outcome,
        Some(IncidentOutcome::Failed),
        "{:?}",
        failed.history[0]
    );
    s.wait_event_saying(
        &node,
        FindingKind::NodeDeleted.as_str(),
        attempt.id.as_str(),
    )
    .await
    .expect("said in an Event about the Node");
    until_set(
        dra::rules(&s.client).await.expect("rules"),
        watcher::Config::default().labels(&format!("{RULE_NODE_LABEL}={node}")),
        "the gone GPU's fence down",
        WAIT,
        |set| set.is_empty(),
    )
    .await
    .expect("no fence left for a Node of the name registered later");
    s.wait_status(&node, "the fence forgotten", |st| st.quarantine.is_none())
        .await
        .expect("forgotten");

    until_set(
        Api::<gpuhealth_api::GpuNodeHealth>::all(s.client.clone()),
        watcher::Config::default().fields(&format!("metadata.name={quiet}")),
        "the quiet node's record gone",
        WAIT,
        |set| set.is_empty(),
    )
    .await
    .expect("a record with nothing under way goes with its node");
    // Still there, and still saying why.
    let kept = Api::<gpuhealth_api::GpuNodeHealth>::all(s.client.clone())
        .get(&node)
        .await
        .expect("the failed incident's record stays");
    assert_eq!(
        kept.status.and_then(|st| st.reason),
        Some(Reason::NodeDeleted)
    );
}
