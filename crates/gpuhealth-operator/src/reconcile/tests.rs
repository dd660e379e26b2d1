//! The reconcile's stages against the fake API server: the fence first
//! (it records its incident), then the status, then the rest; a record
//! taken back when nothing of it was written, kept once its fence was; and
//! the check of a start against a fresh list just after a takeover.

use std::time::Duration;

use gpuhealth_api::{
    GpuHealthPolicy, GpuNodeHealth,
    contract::{CORDONED_BY_ANNOTATION, GPU_REPORT_ANNOTATION},
    node_health::{GpuNodeHealthStatus, Phase},
    vocabulary::Reason,
};
use gpuhealth_engine::machine::ActionKind;
use k8s_openapi::{api::core::v1::Node, jiff::Timestamp};
use serde_json::{Value, json};

use super::reconcile_node;
use crate::{
    context::Error,
    testing::{World, cache},
};

const NODE: &str = "gpu-node-1";
const OTHER: &str = "gpu-node-2";
const THIRD: &str = "gpu-node-3";
const POLICY: &str = "serving";
const STATUS: &str = "/apis/gpuhealth.io/v1alpha1/gpunodehealths/gpu-node-1/status";
const CORDON: &str = "PATCH /api/v1/nodes/gpu-node-1";

/// A node whose agent reports the incident's Xids on one GPU, now.
fn faulty(name: &str) -> Node {
    let mut report: Value = serde_json::from_str(include_str!(
        "../../../gpuhealth-api/tests/fixtures/incident-gpu-report.json"
    ))
    .expect("the incident's report");
    report["observedAt"] = json!(Timestamp::now().to_string());
    serde_json::from_value(json!({
        "metadata": {
            "name": name,
            "resourceVersion": "7",
            "annotations": {GPU_REPORT_ANNOTATION: report.to_string()},
        },
    }))
    .expect("node")
}

fn healthy(name: &str) -> Node {
    serde_json::from_value(json!({"metadata": {"name": name}})).expect("node")
}

/// An enforcing policy over every node, `max_concurrent` remediations at
/// a time.
fn policy(max_concurrent: u32) -> GpuHealthPolicy {
    serde_json::from_value(json!({
        "apiVersion": "gpuhealth.io/v1alpha1",
        "kind": "GpuHealthPolicy",
        "metadata": {"name": POLICY},
        "spec": {"nodeSelector": {}, "mode": "Enforce", "maxConcurrent": max_concurrent},
    }))
    .expect("policy")
}

/// `OTHER`'s record: remediating under the policy.
fn other_remediating() -> Value {
    json!({
        "apiVersion": "gpuhealth.io/v1alpha1",
        "kind": "GpuNodeHealth",
        "metadata": {"name": OTHER, "resourceVersion": "9"},
        "spec": {},
        "status": {"phase": Phase::Draining, "policy": POLICY, "incident": "inc-1764950000-000000000001"},
    })
}

/// One remediation at a time.
fn world(led_for: Duration) -> World {
    world_of(led_for, 1)
}

fn world_of(led_for: Duration, max_concurrent: u32) -> World {
    let mut w = World::new(led_for);
    cache(&mut w.policies, policy(max_concurrent));
    cache(&mut w.nodes, faulty(NODE));
    cache(&mut w.nodes, healthy(OTHER));
    // A fleet large enough that one node under way is no storm (the
    // circuit breaker's business, not this test's), each node with its
    // record, as the operator keeps one for every node it manages (the
    // cluster's bound on nodes disrupted at once counts them).
    for i in 4..=20 {
        let name = format!("gpu-node-{i}");
        cache(&mut w.nodes, healthy(&name));
        let record = json!({
            "apiVersion": "gpuhealth.io/v1alpha1",
            "kind": "GpuNodeHealth",
            "metadata": {"name": name},
            "spec": {},
            "status": {"phase": Phase::Healthy, "policy": POLICY},
        });
        w.cache_health(serde_json::from_value(record).expect("record"));
    }
    w
}

fn decided_phase(w: &World) -> Option<Phase> {
    w.ctx.lock_decisions().get(NODE).map(|s| s.phase)
}

#[tokio::test]
async fn the_cordon_is_the_first_write_and_its_status_follows() {
    let w = world(Duration::from_secs(600));
    reconcile_node(&faulty(NODE), &w.ctx)
        .await
        .expect("reconciled");
    let lines = w.api.lines();
    let at = |line: &str| {
        lines
            .iter()
            .position(|l| l == line)
            .unwrap_or_else(|| panic!("no {line}: {lines:?}"))
    };
    assert!(at(CORDON) < at(&format!("PATCH {STATUS}")), "{lines:?}");
    assert_eq!(
        lines.iter().filter(|l| *l == CORDON).count(),
        1,
        "cordoned once: {lines:?}"
    );
    // The cordon's record names the incident the status opens.
    let seen = w.api.seen();
    let cordon = seen.iter().find(|s| s.line() == CORDON).expect("cordon");
    let record = cordon.body["metadata"]["annotations"][CORDONED_BY_ANNOTATION]
        .as_str()
        .expect("the record");
    let decided = w.ctx.lock_decisions().get(NODE).cloned().expect("recorded");
    assert_eq!(decided.phase, Phase::Quarantined);
    let incident = decided.incident.expect("an incident");
    assert!(record.contains(&incident), "{record} names {incident}");
}

#[tokio::test]
async fn a_cordon_that_fails_writes_no_status_and_takes_its_record_back() {
    let w = world(Duration::from_secs(600));
    // A decision this process made earlier, which the watch has not shown.
    let before = GpuNodeHealthStatus {
        phase: Phase::Suspect,
        policy: Some(POLICY.into()),
        ..Default::default()
    };
    w.ctx.lock_decisions().insert(NODE.into(), before.clone());
    w.api.on("PATCH", "/nodes/", 500);
    let error = reconcile_node(&faulty(NODE), &w.ctx)
        .await
        .expect_err("the cordon failed");
    assert!(
        matches!(&error, Error::Act { node, action: ActionKind::Cordon, .. } if node == NODE),
        "{error:?}"
    );
    let lines = w.api.lines();
    assert!(!lines.iter().any(|l| l.ends_with("/status")), "{lines:?}");
    assert_eq!(w.ctx.lock_decisions().get(NODE), Some(&before));
}

#[tokio::test]
async fn a_status_that_fails_after_its_cordon_stays_recorded() {
    let w = world(Duration::from_secs(600));
    w.api.on("PATCH", "/status", 500);
    let error = reconcile_node(&faulty(NODE), &w.ctx)
        .await
        .expect_err("the status write failed");
    assert!(
        matches!(&error, Error::WriteStatus { node, .. } if node == NODE),
        "{error:?}"
    );
    assert!(w.api.lines().contains(&CORDON.to_owned()));
    // The cordon names the incident: the budget goes on counting it, and
    // the next reconcile writes the status from this record.
    assert_eq!(decided_phase(&w), Some(Phase::Quarantined));
}

#[tokio::test]
async fn a_decision_without_a_fence_whose_status_fails_is_taken_back() {
    let mut w = world(Duration::from_secs(600));
    let other: GpuNodeHealth = serde_json::from_value(other_remediating()).expect("record");
    w.cache_health(other);
    w.api.on("PATCH", "/status", 500);
    let error = reconcile_node(&faulty(NODE), &w.ctx)
        .await
        .expect_err("the status write failed");
    assert!(matches!(error, Error::WriteStatus { .. }), "{error:?}");
    assert!(!w.api.lines().contains(&CORDON.to_owned()));
    assert_eq!(decided_phase(&w), None, "the budget no longer counts it");
}

#[tokio::test]
async fn just_after_a_takeover_a_start_the_api_server_has_no_budget_for_waits() {
    let w = world(Duration::from_secs(5));
    // The cache shows nothing under way; the API server, the previous
    // leader's last start.
    w.api.on_with("GET", "/gpunodehealths", |_| {
        (
            200,
            json!({"metadata": {"resourceVersion": "10"}, "items": [other_remediating()]}),
        )
    });
    let requeue = reconcile_node(&faulty(NODE), &w.ctx)
        .await
        .expect("held back");
    assert_eq!(
        requeue,
        kube::runtime::controller::Action::requeue(Duration::from_secs(2))
    );
    let lines = w.api.lines();
    assert!(
        lines
            .iter()
            .any(|l| l == "GET /apis/gpuhealth.io/v1alpha1/gpunodehealths"),
        "{lines:?}"
    );
    assert!(
        !lines.iter().any(|l| l.starts_with("PATCH")),
        "nothing written: {lines:?}"
    );
    assert_eq!(decided_phase(&w), None, "the start is taken back");
}

#[tokio::test]
async fn just_after_a_takeover_a_start_the_api_server_agrees_to_goes_ahead() {
    let w = world(Duration::from_secs(5));
    reconcile_node(&faulty(NODE), &w.ctx)
        .await
        .expect("reconciled");
    let lines = w.api.lines();
    assert!(
        lines.iter().any(|l| l.ends_with("/gpunodehealths")),
        "{lines:?}"
    );
    assert!(lines.contains(&CORDON.to_owned()), "{lines:?}");
}

#[tokio::test]
async fn the_starts_of_a_terms_first_minute_share_one_list() {
    // Two starts at once, both within the budget, both confirmed.
    let mut w = world_of(Duration::from_secs(5), 2);
    cache(&mut w.nodes, faulty(THIRD));
    let (one, three) = (faulty(NODE), faulty(THIRD));
    let (first, second) =
        tokio::join!(reconcile_node(&one, &w.ctx), reconcile_node(&three, &w.ctx));
    first.expect("started");
    second.expect("started");
    let lines = w.api.lines();
    let lists = lines
        .iter()
        .filter(|l| l.ends_with("/gpunodehealths"))
        .count();
    assert_eq!(lists, 1, "{lines:?}");
    for node in [NODE, THIRD] {
        let cordon = format!("PATCH /api/v1/nodes/{node}");
        assert!(lines.contains(&cordon), "{node}: {lines:?}");
    }
}

#[tokio::test]
async fn the_list_after_a_takeover_is_read_a_page_at_a_time() {
    let w = world(Duration::from_secs(5));
    w.api.on_with("GET", "/gpunodehealths", |seen| {
        let page = if seen.uri.contains("continue=page-2") {
            json!({"metadata": {"resourceVersion": "10"}, "items": [other_remediating()]})
        } else {
            json!({"metadata": {"resourceVersion": "10", "continue": "page-2"}, "items": []})
        };
        (200, page)
    });
    reconcile_node(&faulty(NODE), &w.ctx)
        .await
        .expect("held back");
    let lists: Vec<String> = w
        .api
        .seen()
        .into_iter()
        .filter(|s| s.line().ends_with("/gpunodehealths"))
        .map(|s| s.uri)
        .collect();
    assert_eq!(lists.len(), 2, "{lists:?}");
    assert!(lists.iter().all(|u| u.contains("limit=500")), "{lists:?}");
    assert!(
        !w.api.lines().contains(&CORDON.to_owned()),
        "the second page held it back"
    );
}

#[tokio::test]
async fn a_leader_past_its_first_minute_trusts_its_cache() {
    let mut w = world(Duration::from_secs(600));
    let other: GpuNodeHealth = serde_json::from_value(other_remediating()).expect("record");
    w.cache_health(other);
    // The cache shows the budget spent: no start, and no list to learn it.
    reconcile_node(&faulty(NODE), &w.ctx)
        .await
        .expect("reconciled");
    let lines = w.api.lines();
    assert!(
        !lines.iter().any(|l| l.ends_with("/gpunodehealths")),
        "{lines:?}"
    );
    assert!(!lines.contains(&CORDON.to_owned()), "{lines:?}");
    let held = w.ctx.lock_decisions().get(NODE).and_then(|s| s.reason);
    assert_eq!(held, Some(Reason::WaitingForBudget));
}

/// A node whose agent reports one healthy GPU, now.
fn reporting_healthy(name: &str) -> Node {
    let report = json!({
        "version": 1,
        "observedAt": Timestamp::now().to_string(),
        "source": "gpuhealth-agent/nvml",
        "gpus": [{"index": 0, "uuid": "GPU-0a1b2c3d-0000-4000-8000-000000000000",
            "pciBusId": "00000000:01:00.0", "health": "Healthy"}],
    });
    serde_json::from_value(json!({
        "metadata": {"name": name, "annotations": {GPU_REPORT_ANNOTATION: report.to_string()}},
    }))
    .expect("node")
}

/// `NODE`'s record holding `status`, as the API server serves it.
fn record_of(status: &Value) -> GpuNodeHealth {
    serde_json::from_value(json!({
        "apiVersion": "gpuhealth.io/v1alpha1",
        "kind": "GpuNodeHealth",
        "metadata": {"name": NODE, "resourceVersion": "11"},
        "spec": {},
        "status": status,
    }))
    .expect("record")
}

fn status_writes(w: &World) -> Vec<Value> {
    w.api
        .seen()
        .into_iter()
        .filter(|s| s.line() == format!("PATCH {STATUS}"))
        .map(|s| s.body["status"].clone())
        .collect()
}

/// A world where `NODE`, reporting one healthy GPU, was reconciled once
/// and the watch showed the status written: returns that status.
async fn written_and_watched() -> (World, Value) {
    let mut w = world(Duration::from_secs(600));
    reconcile_node(&reporting_healthy(NODE), &w.ctx)
        .await
        .expect("reconciled");
    let written = status_writes(&w);
    assert_eq!(written.len(), 1, "{:?}", w.api.lines());
    assert_eq!(written[0]["gpus"].as_array().map(Vec::len), Some(1));
    w.cache_health(record_of(&written[0]));
    (w, written[0].clone())
}

/// The record's own path: what the operator's role may get.
const RECORD: &str = "/apis/gpuhealth.io/v1alpha1/gpunodehealths/gpu-node-1";

#[tokio::test]
async fn a_status_the_cluster_holds_is_not_written_again_though_the_cache_left_its_table_out() {
    let (w, _) = written_and_watched().await;
    // The watch showed the write: the cache keeps it without its table.
    let cached = w.ctx.node_health.state();
    let cached = cached
        .iter()
        .find(|r| r.metadata.name.as_deref() == Some(NODE));
    assert_eq!(
        cached.and_then(|r| r.status.as_ref()).map(|s| s.gpus.len()),
        Some(0)
    );
    reconcile_node(&reporting_healthy(NODE), &w.ctx)
        .await
        .expect("reconciled again");
    assert_eq!(status_writes(&w).len(), 1, "{:?}", w.api.lines());
    assert!(w.ctx.lock_decisions().get(NODE).is_none(), "caught up");
    // A readable report rebuilds the table: the record is never read.
    let lines = w.api.lines();
    assert!(
        !lines
            .iter()
            .any(|l| l.starts_with("GET ") && l.contains(RECORD)),
        "{lines:?}"
    );
}

#[tokio::test]
async fn a_report_that_cannot_be_read_keeps_the_clusters_gpu_table() {
    let (w, table) = written_and_watched().await;
    w.ctx.lock_decisions().clear();
    // The cluster's record, table and all, for the read the cache cannot
    // answer; its status subresource the operator's role may not get.
    w.api.on_with("GET", RECORD, move |_| {
        (200, serde_json::to_value(record_of(&table)).expect("json"))
    });
    w.api.on("GET", "/status", 403);
    let mut garbled = reporting_healthy(NODE);
    garbled
        .metadata
        .annotations
        .get_or_insert_default()
        .insert(GPU_REPORT_ANNOTATION.into(), "{not json".into());
    reconcile_node(&garbled, &w.ctx).await.expect("reconciled");
    let written = status_writes(&w);
    assert_eq!(
        written.len(),
        2,
        "the report's problem is news: {:?}",
        w.api.lines()
    );
    assert_eq!(
        written[1]["gpus"], written[0]["gpus"],
        "the table the cluster held"
    );
}
