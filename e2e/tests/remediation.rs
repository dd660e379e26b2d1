//! Remediation end to end on the real API server: the operator binary, KWOK
//! GPU nodes with a vLLM-like Deployment across their eight GPUs, and the
//! fake agent. One scenario at a time (see `Scenario`).
//!
//! Long because each test is one whole remediation against a real API
//! server, and they share its setup.

use std::{
    sync::{Arc, Mutex},
    time::Instant,
};

use futures::StreamExt;
use gpuhealth_api::{
    GpuHealth, GpuHealthPolicy, GpuNodeHealth, RecoveryAction,
    contract::{
        AnnotationValue, CORDONED_BY_ANNOTATION, GPU_REPORT_ANNOTATION, GpuReport,
        REBOOT_REQUEST_ANNOTATION, RESET_REQUEST_ANNOTATION, ResetRequest, XidEvent,
    },
    node_health::Phase,
    policy::{Mode, ValidationPod},
    vocabulary::{
        Attempt, AttemptAction,
        AttemptOutcome::{Failed, Succeeded},
        FindingKind, IncidentOutcome, PodKey, Reason, WorkloadOutcome,
    },
};
use gpuhealth_e2e::{
    agent::{Answer, Request},
    reports,
    scenario::{Scenario, WAIT},
    sim::is_cordoned,
    wait::{Background, applied, events, until, until_set},
};
use gpuhealth_engine::machine::{POLL, is_disruptive};
use k8s_openapi::{
    api::{
        core::v1::{Namespace, Node, Pod, ServiceAccount},
        policy::v1::PodDisruptionBudget,
    },
    apimachinery::pkg::{apis::meta::v1::Time, util::intstr::IntOrString},
    jiff::Timestamp,
};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, Patch, PatchParams, PostParams},
    runtime::watcher,
};
use serde_json::json;

/// From a watch on a node: when its report first showed a bad GPU, when it
/// was first cordoned, and whether that cordon was attributed to gpuhealth.
type Seen = (Option<Instant>, Option<Instant>, bool);

/// Whether `managedFields` gives `spec.unschedulable` to the operator's
/// field manager, as `kubectl` and an audit see it.
fn cordoned_by_gpuhealth(node: &Node) -> bool {
    node.metadata.managed_fields.iter().flatten().any(|m| {
        m.manager.as_deref() == Some("gpuhealth-operator")
            && m.fields_v1
                .as_ref()
                .is_some_and(|f| f.0.to_string().contains("\"f:unschedulable\""))
    })
}

fn set(answer: &Arc<std::sync::Mutex<Answer>>, value: Answer) {
    if let Ok(mut a) = answer.lock() {
        *a = value;
    }
}

#[tokio::test]
async fn the_incident_gpu_7_is_reset_and_the_node_returns_to_service() {
    let mut s = Scenario::new("incident", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    // One disruption at a time.
    s.add_pdb("vllm", 1).await.expect("pdb");
    // The real agent binary serves the node (fake backend: the GPU breaks
    // in its simulated hardware, and the agent reports it).
    s.start_with_agent_binaries()
        .await
        .expect("operator and agent");
    let pods_before = s.pods_on(&node).await.expect("pods");

    // From a watch on the node: when the agent's report shows the bad GPU,
    // and when the node is cordoned.
    let seen: Arc<Mutex<Seen>> = Arc::default();
    let node_watch = {
        let seen = seen.clone();
        let config = watcher::Config::default().fields(&format!("metadata.name={node}"));
        let nodes: Api<Node> = Api::all(s.client.clone());
        Background::spawn(async move {
            let mut stream = std::pin::pin!(applied(nodes, config));
            while let Some(n) = stream.next().await {
                let bad = n
                    .annotations()
                    .get(GPU_REPORT_ANNOTATION)
                    .and_then(|v| GpuReport::parse(v).ok())
                    .is_some_and(|r| r.bad_gpus().next().is_some());
                let cordoned = is_cordoned(&n);
                if let Ok(mut s) = seen.lock() {
                    if bad {
                        s.0.get_or_insert_with(Instant::now);
                    }
                    if cordoned {
                        s.1.get_or_insert_with(Instant::now);
                        s.2 |= cordoned_by_gpuhealth(&n);
                    }
                }
            }
        })
    };

    let broken = Instant::now();
    s.break_gpu(&node, 7).await.expect("Xid 119 + 154 on GPU 7");
    let status = s.wait_recovered(&node).await.expect("the node recovers");
    drop(node_watch);

    let (reported, cordoned, attributed) = seen.lock().map(|s| *s).unwrap_or_default();
    assert!(
        attributed,
        "the cordon is the operator's in managedFields, not `unknown`"
    );
    let reported = reported.expect("the agent reported the bad GPU");
    let cordoned = cordoned.expect("the node was cordoned");
    eprintln!(
        "GPU breaks -> agent's report: {:?}; report -> cordon: {:?}",
        reported.duration_since(broken),
        cordoned.saturating_duration_since(reported)
    );

    let gpu7 = reports::healthy(&s.namespace, &pods_before).gpus[7]
        .uuid
        .clone();
    let n = s.node(&node).await.expect("node");
    let request = n
        .annotations()
        .get(RESET_REQUEST_ANNOTATION)
        .and_then(|v| ResetRequest::parse(v).ok())
        .expect("a reset request");
    assert_eq!(
        request.gpus,
        std::slice::from_ref(&gpu7),
        "a reset of exactly GPU 7"
    );
    assert_eq!(
        s.executed(&node).await.expect("hardware"),
        [request.id.to_string()],
        "the agent carried out one reset"
    );
    let pods_after = s.pods_on(&node).await.expect("pods");
    assert!(
        !pods_after.contains(&pods_before[7]),
        "the pod on GPU 7 was evicted"
    );
    for other in &pods_before[..7] {
        assert!(
            pods_after.contains(other),
            "{other} kept running: {pods_after:?}"
        );
    }
    let n = s.node(&node).await.expect("node");
    assert!(!is_cordoned(&n), "uncordoned");
    assert!(
        !n.annotations().contains_key(CORDONED_BY_ANNOTATION),
        "ownership record removed with the cordon"
    );
    assert_eq!(
        status.history[0].attempts,
        [Attempt::new(RecoveryAction::GpuReset, 1, Succeeded)]
    );
    for reason in [
        Reason::Draining.as_str(),
        Reason::ActionRequested.as_str(),
        Reason::Verifying.as_str(),
        IncidentOutcome::Recovered.as_str(),
    ] {
        s.wait_event(&node, reason)
            .await
            .expect("an Event for each step");
    }
    // The pod on GPU 7 was told, on itself, before it was moved.
    s.wait_event(&pods_before[7], FindingKind::PodOnBadGpu.as_str())
        .await
        .expect("an Event on the pod that held the bad GPU");
    assert!(
        status
            .findings
            .iter()
            .any(|f| f.type_ == FindingKind::PodOnBadGpu
                && f.subject.as_ref().map(ToString::to_string)
                    == Some(format!("{}/{}", s.namespace, pods_before[7]))),
        "{:?}",
        status.findings
    );
    // The evicted vLLM pod's workload is serving again, wherever its
    // replacement runs: the incident says so, and finds nothing wrong.
    let status = s.wait_workloads_judged(&node).await.expect("judged");
    let watch = status.history[0].workloads.clone().expect("workloads");
    assert_eq!(watch.outcome, Some(WorkloadOutcome::Recovered), "{watch:?}");
    assert_eq!(watch.evicted.len(), 1, "{watch:?}");
    assert!(watch.evicted[0].starts_with(&format!("ReplicaSet/{}/vllm-", s.namespace)));
    assert!(
        !status
            .findings
            .iter()
            .any(|f| f.type_ == FindingKind::WorkloadNotRecovered
                || f.type_ == FindingKind::StartupProbeTooShort),
        "{:?}",
        status.findings
    );
    s.wait_event_saying(&node, "WorkloadsRecovered", &status.history[0].id)
        .await
        .expect("an Event saying so");
}

#[tokio::test]
async fn a_failed_reset_escalates_to_a_reboot() {
    let mut s = Scenario::new("escalate", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    set(&s.agent.reset, Answer::Fail);
    s.start().await.expect("start");
    let boot_before = s
        .node(&node)
        .await
        .expect("node")
        .status
        .and_then(|s| s.node_info)
        .map(|i| i.boot_id);
    s.break_gpu(&node, 7).await.expect("break");
    let status = s
        .wait_status(&node, "recovered by reboot", |st| {
            st.phase == Phase::Healthy && st.history.first().is_some_and(|i| i.outcome.is_some())
        })
        .await
        .expect("recovers");
    assert_eq!(
        status.history[0].attempts,
        [
            Attempt::new(RecoveryAction::GpuReset, 1, Failed),
            Attempt::new(RecoveryAction::NodeReboot, 1, Succeeded),
        ]
    );
    let requests = s.agent.requests();
    assert!(
        matches!(
            requests.as_slice(),
            [Request::Reset { .. }, Request::Reboot { .. }]
        ),
        "{requests:?}"
    );
    let boot_after = s
        .node(&node)
        .await
        .expect("node")
        .status
        .and_then(|s| s.node_info)
        .map(|i| i.boot_id);
    assert_ne!(boot_before, boot_after, "the reboot changed the bootID");
}

#[tokio::test]
async fn when_reset_and_reboot_fail_the_node_stays_cordoned_for_a_person() {
    let mut s = Scenario::new("exhaust", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    set(&s.agent.reset, Answer::Fail);
    set(&s.agent.reboot, Answer::Fail);
    s.start().await.expect("start");
    s.break_gpu(&node, 7).await.expect("break");
    let status = s
        .wait_status(&node, "failed", |st| st.phase == Phase::Failed)
        .await
        .expect("Failed");
    assert_eq!(status.reason, Some(Reason::EscalationExhausted));
    let message = status.message.unwrap_or_default();
    assert!(
        message.contains("inspect") && message.contains("uncordon"),
        "says what a person should do: {message}"
    );
    let n = s.node(&node).await.expect("node");
    assert!(is_cordoned(&n), "stays cordoned");
}

#[tokio::test]
async fn xid_79_starts_at_the_reboot_rung_and_drains_every_pod() {
    let mut s = Scenario::new("xid79", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    s.start().await.expect("start");
    let pods_before = s.pods_on(&node).await.expect("pods");
    let mut report: GpuReport = reports::healthy(&s.namespace, &pods_before);
    report.gpus[3].health = GpuHealth::Lost;
    report.gpus[3].xids = vec![XidEvent::new(
        79,
        Time(Timestamp::now()),
        "GPU has fallen off the bus.",
    )];
    s.write_report(&node, report).await.expect("Xid 79");
    let status = s
        .wait_status(&node, "recovered by reboot", |st| {
            st.phase == Phase::Healthy && st.history.first().is_some_and(|i| i.outcome.is_some())
        })
        .await
        .expect("recovers");
    assert_eq!(
        status.history[0].attempts,
        [Attempt::new(RecoveryAction::NodeReboot, 1, Succeeded)]
    );
    assert!(
        matches!(s.agent.requests().as_slice(), [Request::Reboot { .. }]),
        "no reset, one reboot"
    );
    let pods_after = s.pods_on(&node).await.expect("pods");
    assert!(
        pods_before.iter().all(|p| !pods_after.contains(p)),
        "every pod was drained: {pods_after:?}"
    );
}

#[tokio::test]
async fn someone_elses_cordon_is_left_in_place_and_a_budget_at_zero_is_named() {
    let mut s = Scenario::new("foreign", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    let holder = s.pods_on(&node).await.expect("pods")[7].clone();
    s.add_pdb("vllm", 0)
        .await
        .expect("a budget that allows nothing");
    s.start().await.expect("start");
    let nodes: Api<Node> = Api::all(s.client.clone());
    nodes
        .patch(
            &node,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"unschedulable": true}})),
        )
        .await
        .expect("a person cordons the node");
    s.break_gpu(&node, 7).await.expect("break");
    // gpuhealth says it kept that cordon, not that it made one.
    let kept = "kept the cordon someone else made";
    s.wait_event_saying(&node, Reason::Xid.as_str(), kept)
        .await
        .expect("the quarantine's Event");
    // The drain waits on the budget, which status and an Event name, as
    // soon as the drain has looked at it.
    let ns = &s.namespace;
    let held = s
        .wait_status(&node, "held by the budget", |st| {
            st.reason == Some(Reason::WaitingForDisruptionBudget)
        })
        .await
        .expect("the drain names its holder");
    let named = format!("{ns}/vllm: allows 0 disruption(s) now for pod {ns}/{holder} to evict");
    let message = held.message.unwrap_or_default();
    assert!(message.contains(&named), "{message}");
    s.wait_event_saying(
        &node,
        Reason::WaitingForDisruptionBudget.as_str(),
        &format!("{ns}/vllm"),
    )
    .await
    .expect("an Event names the budget");
    assert!(s.agent.requests().is_empty(), "no reset while it waits");
    // The budget allows one again: the drain goes on.
    Api::<PodDisruptionBudget>::namespaced(s.client.clone(), ns)
        .patch(
            "vllm",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"maxUnavailable": 1}})),
        )
        .await
        .expect("the budget allows one");
    s.wait_recovered(&node).await.expect("recovers");
    let n = s.node(&node).await.expect("node");
    assert!(is_cordoned(&n), "the person's cordon stays");
}

#[tokio::test]
async fn a_never_pod_is_not_evicted_and_holds_the_node_until_it_goes() {
    let mut s = Scenario::new("never", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    let pods_before = s.pods_on(&node).await.expect("pods");
    let holder = pods_before[7].clone();
    let pods: Api<Pod> = Api::namespaced(s.client.clone(), &s.namespace);
    let never =
        json!({"metadata": {"annotations": {"gpuhealth.io/disruption-tolerance": "never"}}});
    pods.patch(&holder, &PatchParams::default(), &Patch::Merge(never))
        .await
        .expect("annotate");
    s.start().await.expect("start");
    s.break_gpu(&node, 7).await.expect("break");
    let waiting = s
        .wait_status(&node, "waiting for the pod", |st| {
            st.reason == Some(Reason::WaitingForPod)
        })
        .await
        .expect("waits");
    assert!(
        waiting.message.unwrap_or_default().contains(&holder),
        "the reason names the pod"
    );
    assert!(
        s.pods_on(&node).await.expect("pods").contains(&holder),
        "not evicted"
    );
    assert!(
        s.agent.requests().is_empty(),
        "no reset while the pod holds the GPU"
    );
    // Its owner takes it away; remediation continues.
    pods.delete(&holder, &DeleteParams::default())
        .await
        .expect("delete");
    s.wait_recovered(&node).await.expect("recovers");
}

#[tokio::test]
async fn dry_run_records_the_plan_and_writes_no_node_or_pod() {
    let mut spec = Scenario::quick_spec();
    spec.mode = Mode::DryRun;
    let mut s = Scenario::new("dryrun", 1, spec).await.expect("scenario");
    let node = s.nodes[0].clone();
    s.add_pdb("vllm", 1).await.expect("pdb");
    s.start().await.expect("start");
    let pods_before = s.pods_on(&node).await.expect("pods");

    // Record every write gpuhealth could make to the node or its pods.
    let writes: Arc<Mutex<Vec<String>>> = Arc::default();
    let node_watch = {
        let writes = writes.clone();
        let config = watcher::Config::default().fields(&format!("metadata.name={node}"));
        let nodes: Api<Node> = Api::all(s.client.clone());
        Background::spawn(async move {
            let mut stream = std::pin::pin!(applied(nodes, config));
            while let Some(n) = stream.next().await {
                let ours = [
                    CORDONED_BY_ANNOTATION,
                    RESET_REQUEST_ANNOTATION,
                    REBOOT_REQUEST_ANNOTATION,
                ];
                let touched =
                    is_cordoned(&n) || ours.iter().any(|k| n.annotations().contains_key(*k));
                if touched && let Ok(mut w) = writes.lock() {
                    w.push(format!("node written: {:?}", n.metadata.annotations));
                }
            }
        })
    };
    let pod_watch = {
        let writes = writes.clone();
        let pods: Api<Pod> = Api::namespaced(s.client.clone(), &s.namespace);
        Background::spawn(async move {
            let mut stream = std::pin::pin!(events(pods, watcher::Config::default()));
            while let Some(event) = stream.next().await {
                if let watcher::Event::Apply(p) | watcher::Event::Delete(p) = event
                    && p.metadata.deletion_timestamp.is_some()
                    && let Ok(mut w) = writes.lock()
                {
                    w.push(format!("pod deleted: {}", p.name_any()));
                }
            }
        })
    };

    s.break_gpu(&node, 7).await.expect("break");
    let status = s
        .wait_status(&node, "a dry-run plan", |st| st.plan.is_some())
        .await
        .expect("plan");
    let plan = status.plan.expect("plan");
    assert_eq!(status.reason, Some(Reason::DryRun));
    assert!(plan.cordon);
    assert_eq!(plan.action, Some(gpuhealth_api::RecoveryAction::GpuReset));
    assert_eq!(plan.evict, [PodKey::new(&s.namespace, &pods_before[7])]);
    assert_eq!(
        plan.disruption_budgets,
        [format!(
            "{}/vllm: allows 1 disruption(s) now for pod {}/{} to evict; all could go now",
            s.namespace, s.namespace, pods_before[7]
        )]
    );
    // A second bad GPU: the plan follows, and still nothing is written.
    let mut report = reports::healthy(&s.namespace, &pods_before);
    reports::xid_119_and_154(&mut report, 6);
    reports::xid_119_and_154(&mut report, 7);
    s.write_report(&node, report).await.expect("second signal");
    let status = s
        .wait_status(&node, "the plan updated", |st| {
            st.plan.as_ref().is_some_and(|p| p.evict.len() == 2)
        })
        .await
        .expect("plan updated");
    let plan = status.plan.expect("plan");
    assert_eq!(
        plan.disruption_budgets,
        [format!(
            "{}/vllm: allows 1 disruption(s) now for 2 pods ({}, …) to evict; the rest would wait their turn",
            s.namespace, plan.evict[0]
        )]
    );
    // The budget drops to zero: the plan says so by the next reconcile
    // (the budget's change starts one; the plan's poll is the backstop).
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(s.client.clone(), &s.namespace);
    pdbs.patch(
        "vllm",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"maxUnavailable": 0}})),
    )
    .await
    .expect("the budget drops to zero");
    until(pdbs, "vllm", WAIT, |p| {
        p.status.as_ref().and_then(|s| s.disruptions_allowed) == Some(0)
    })
    .await
    .expect("the disruption controller says zero");
    let next_reconcile = POLL + std::time::Duration::from_secs(5);
    let zero = format!("{}/vllm: allows 0 disruption(s) now", s.namespace);
    let status = until(
        Api::<GpuNodeHealth>::all(s.client.clone()),
        &node,
        next_reconcile,
        |g| {
            g.status
                .as_ref()
                .and_then(|st| st.plan.as_ref())
                .is_some_and(|p| p.disruption_budgets.iter().any(|b| b.starts_with(&zero)))
        },
    )
    .await
    .expect("the plan follows the budget");
    assert!(
        status
            .status
            .and_then(|st| st.plan)
            .is_some_and(|p| p.disruption_budgets.iter().any(|b| b.ends_with(
                "each eviction would be refused (429) and retried until it allows one"
            ))),
        "the plan says what the budget means"
    );
    drop(node_watch);
    drop(pod_watch);
    let writes = writes.lock().map(|w| w.clone()).unwrap_or_default();
    assert!(writes.is_empty(), "DryRun wrote: {writes:?}");
    assert!(s.agent.requests().is_empty());
}

#[tokio::test]
async fn a_malformed_gpu_report_is_an_event_not_an_action() {
    let mut s = Scenario::new("malformed", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    s.start().await.expect("start");
    let nodes: Api<Node> = Api::all(s.client.clone());
    let bad = json!({"metadata": {"annotations": {"gpuhealth.io/gpus": "{\"version\": 1, \"gpus\": [{\"uuid\": \"GPU-' OR 1=1"}}});
    nodes
        .patch(&node, &PatchParams::default(), &Patch::Merge(bad))
        .await
        .expect("malformed report");
    let status = s
        .wait_status(&node, "a finding", |st| {
            st.findings
                .iter()
                .any(|f| f.type_ == FindingKind::MalformedGpuReport)
        })
        .await
        .expect("finding");
    assert_eq!(status.phase, Phase::Healthy);
    s.wait_event(&node, FindingKind::MalformedGpuReport.as_str())
        .await
        .expect("an Event");
    // A second, different error is an Event of its own, not a repeat of
    // the first in its series.
    let other = json!({"metadata": {"annotations": {"gpuhealth.io/gpus": "{\"version\": 99, \"observedAt\": \"2026-01-01T00:00:00Z\", \"gpus\": []}"}}});
    nodes
        .patch(&node, &PatchParams::default(), &Patch::Merge(other))
        .await
        .expect("another malformed report");
    s.wait_event_saying(
        &node,
        FindingKind::MalformedGpuReport.as_str(),
        "version 99 is not supported",
    )
    .await
    .expect("the second error's own Event");
    let n = s.node(&node).await.expect("node");
    assert!(!is_cordoned(&n), "no action");
    let metrics = s
        .operator
        .as_ref()
        .expect("operator")
        .scrape()
        .await
        .expect("metrics");
    let counted = format!(
        "gpuhealth_malformed_gpu_reports_total{{policy=\"{}\",error=\"malformed\"}} 1",
        s.policy
    );
    assert!(metrics.contains(&counted), "{counted} in:\n{metrics}");
    // The operator is still there: a good report after a bad one is acted on.
    s.break_gpu(&node, 7).await.expect("break");
    s.wait_recovered(&node).await.expect("still remediates");
}

#[tokio::test]
async fn max_concurrent_one_takes_three_sick_nodes_one_at_a_time() {
    let mut spec = Scenario::quick_spec();
    spec.max_concurrent = IntOrString::Int(1);
    spec.max_unhealthy = IntOrString::Int(3);
    let mut s = Scenario::new("concurrent", 3, spec)
        .await
        .expect("scenario");
    s.start().await.expect("start");

    // Every status write of the three nodes, as a watcher sees it: the most
    // nodes ever in a disruptive phase at once.
    let most = Arc::new(Mutex::new(0usize));
    let recorder = {
        let most = most.clone();
        let names = s.nodes.clone();
        let api: Api<GpuNodeHealth> = Api::all(s.client.clone());
        Background::spawn(async move {
            let mut phases = std::collections::BTreeMap::new();
            let mut stream = std::pin::pin!(applied(api, watcher::Config::default()));
            while let Some(g) = stream.next().await {
                if !names.contains(&g.name_any()) {
                    continue;
                }
                phases.insert(g.name_any(), g.status.map(|s| s.phase).unwrap_or_default());
                let now = phases.values().filter(|p| is_disruptive(**p)).count();
                if let Ok(mut m) = most.lock() {
                    *m = (*m).max(now);
                }
            }
        })
    };
    for n in &s.nodes {
        s.break_gpu(n, 7).await.expect("break");
    }
    for n in &s.nodes {
        s.wait_recovered(n).await.expect("every node recovers");
    }
    drop(recorder);
    let most = most.lock().map(|m| *m).unwrap_or_default();
    assert_eq!(
        most, 1,
        "one node at a time, and at least one was remediated"
    );
}

#[tokio::test]
async fn the_circuit_breaker_holds_new_remediations_and_closes_on_recovery() {
    let mut spec = Scenario::quick_spec();
    spec.max_unhealthy = IntOrString::Int(1);
    spec.max_concurrent = IntOrString::Int(3);
    let mut s = Scenario::new("breaker", 3, spec).await.expect("scenario");
    let (first, second) = (s.nodes[0].clone(), s.nodes[1].clone());
    // The first node's sick GPU is held by a pod that may never be evicted,
    // so its remediation stays open while the second node falls sick.
    let holder = s.pods_on(&first).await.expect("pods")[7].clone();
    let pods: Api<Pod> = Api::namespaced(s.client.clone(), &s.namespace);
    let never =
        json!({"metadata": {"annotations": {"gpuhealth.io/disruption-tolerance": "never"}}});
    pods.patch(&holder, &PatchParams::default(), &Patch::Merge(never))
        .await
        .expect("annotate");
    s.start().await.expect("start");
    s.break_gpu(&first, 7).await.expect("break");
    s.wait_status(&first, "held by its pod", |st| {
        st.reason == Some(Reason::WaitingForPod)
    })
    .await
    .expect("first waits");

    // Two sick nodes, one allowed: the second does not start.
    s.break_gpu(&second, 7).await.expect("break");
    let held = s
        .wait_status(&second, "held by the breaker", |st| {
            st.reason == Some(Reason::CircuitOpen)
        })
        .await
        .expect("held");
    assert_eq!(held.phase, Phase::Suspect);
    let policies: Api<GpuHealthPolicy> = Api::all(s.client.clone());
    until(policies.clone(), &s.policy, WAIT, |p| {
        circuit(p) == Some("True")
    })
    .await
    .expect("policy shows CircuitOpen");
    s.wait_event(&s.policy, "CircuitOpen")
        .await
        .expect("an Event says why");
    let n = s.node(&second).await.expect("node");
    assert!(!is_cordoned(&n), "no remediation started on the held node");

    // The pod goes, the first node recovers, the breaker closes and the
    // second node is remediated.
    pods.delete(&holder, &DeleteParams::default())
        .await
        .expect("delete");
    s.wait_recovered(&second)
        .await
        .expect("the held node is remediated once the breaker closes");
    until(policies, &s.policy, WAIT, |p| circuit(p) == Some("False"))
        .await
        .expect("CircuitOpen False again");
}

fn circuit(p: &GpuHealthPolicy) -> Option<&str> {
    p.status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "CircuitOpen")
        .map(|c| c.status.as_str())
}

/// A namespace like `config/validation`'s: `restricted` Pod Security
/// enforced, the validation ServiceAccount with no token.
async fn validation_namespace(client: &Client, group: &str) -> String {
    let name = format!("{group}-validation");
    let namespace: Namespace = serde_json::from_value(json!({
        "metadata": {"name": name, "labels": {"pod-security.kubernetes.io/enforce": "restricted"}},
    }))
    .expect("namespace");
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .expect("the validation namespace");
    let account: ServiceAccount = serde_json::from_value(json!({
        "metadata": {"name": "gpuhealth-validation", "namespace": name},
        "automountServiceAccountToken": false,
    }))
    .expect("account");
    Api::<ServiceAccount>::namespaced(client.clone(), &name)
        .create(&PostParams::default(), &account)
        .await
        .expect("the validation ServiceAccount");
    name
}

#[tokio::test]
async fn a_validation_pod_gates_uncordon_and_a_failed_one_escalates() {
    let mut spec = Scenario::quick_spec();
    let mut s = Scenario::new("validate", 1, spec.clone())
        .await
        .expect("scenario");
    // Validation pods run in a namespace of their own that enforces
    // `restricted` Pod Security, as config/validation's, under an account
    // with no token.
    let validation_ns = validation_namespace(&s.client, &s.group).await;
    s.operator_options.validation_namespace = Some(validation_ns.clone());
    spec.verification.validation_pod = Some(ValidationPod {
        template: json!({
            "spec": {"containers": [{"name": "dcgm-diag", "image": "nvcr.io/nvidia/dcgm"}]},
        }),
        timeout: gpuhealth_api::Duration::from_secs(120),
    });
    let mut policy = Api::<GpuHealthPolicy>::all(s.client.clone())
        .get(&s.policy)
        .await
        .expect("policy");
    policy.spec.verification = spec.verification;
    Api::<GpuHealthPolicy>::all(s.client.clone())
        .replace(&s.policy, &PostParams::default(), &policy)
        .await
        .expect("policy with a validation pod");
    let node = s.nodes[0].clone();

    // Plays the validation workload on the simulated node: the first pod
    // fails its diagnostic, every later one passes.
    let ran: Arc<Mutex<Vec<String>>> = Arc::default();
    let kubelet = {
        let ran = ran.clone();
        let pods: Api<Pod> = Api::namespaced(s.client.clone(), &validation_ns);
        Background::spawn(async move {
            let mut stream = std::pin::pin!(applied(pods.clone(), watcher::Config::default()));
            while let Some(p) = stream.next().await {
                let running = p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running");
                if !p.annotations().contains_key("gpuhealth.io/validates") || !running {
                    continue;
                }
                let first = {
                    let Ok(mut r) = ran.lock() else { continue };
                    r.push(p.name_any());
                    r.len() == 1
                };
                let (phase, message) = if first {
                    ("Failed", "dcgmi diag: GPU 7 failed the memory test")
                } else {
                    ("Succeeded", "dcgmi diag: pass")
                };
                let patch = json!({"status": {"phase": phase, "message": message}});
                if let Err(e) = pods
                    .patch_status(&p.name_any(), &PatchParams::default(), &Patch::Merge(patch))
                    .await
                {
                    eprintln!("validation kubelet: {e}");
                }
            }
        })
    };

    s.start().await.expect("start");
    s.break_gpu(&node, 7).await.expect("break");
    let status = s
        .wait_status(&node, "recovered after validation", |st| {
            st.phase == Phase::Healthy && st.history.first().is_some_and(|i| i.outcome.is_some())
        })
        .await
        .expect("recovers");
    drop(kubelet);
    let ran = ran.lock().map(|r| r.clone()).unwrap_or_default();
    assert_eq!(ran.len(), 2, "{ran:?}");
    assert_eq!(
        status.history[0].attempts,
        [
            Attempt::new(RecoveryAction::GpuReset, 1, Succeeded),
            Attempt::new(AttemptAction::ValidationPod, 1, Failed).saying(ran[0].clone()),
            Attempt::new(RecoveryAction::NodeReboot, 1, Succeeded),
            Attempt::new(AttemptAction::ValidationPod, 1, Succeeded).saying(ran[1].clone()),
        ]
    );
    let pods: Api<Pod> = Api::namespaced(s.client.clone(), &validation_ns);
    let failed = pods.get(&ran[0]).await.expect("the failed pod is kept");
    let failed = failed.spec.expect("spec");
    assert_eq!(failed.node_name.as_deref(), Some(node.as_str()));
    // It ran without a token: none asked for, none mounted.
    assert_eq!(failed.automount_service_account_token, Some(false));
    assert_eq!(
        failed.service_account_name.as_deref(),
        Some("gpuhealth-validation")
    );
    let mounts: Vec<String> = failed
        .containers
        .iter()
        .flat_map(|c| c.volume_mounts.iter().flatten())
        .map(|m| m.mount_path.clone())
        .collect();
    assert!(
        !mounts
            .iter()
            .any(|m| m.starts_with("/var/run/secrets/kubernetes.io")),
        "a token mounted: {mounts:?}"
    );
    let passed = ran[1].clone();
    until_set(
        pods,
        watcher::Config::default().fields(&format!("metadata.name={passed}")),
        "the succeeded validation pod to go",
        WAIT,
        |set| {
            set.get(&passed)
                .is_none_or(|p| p.metadata.deletion_timestamp.is_some())
        },
    )
    .await
    .expect("the succeeded pod goes");
    s.wait_event(&node, "AttemptFailed")
        .await
        .expect("an Event");
}
