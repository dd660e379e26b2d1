//! The records gpuhealth acts on are the operator's alone: a GpuNodeHealth
//! (and its status) and a policy's status are written only by the
//! operator's identity, whatever RBAC others hold on gpuhealth.io; and a
//! record someone else wrote anyway (an identity admission lets through,
//! or a cluster whose protection check is skipped) is carried out in
//! nothing: no request, a finding, an Event and a metric.

use std::time::{Duration, Instant};

use gpuhealth_api::{
    GpuHealthPolicy, GpuNodeHealth, RecoveryAction, contract::RequestId, node_health::Phase,
    vocabulary::FindingKind,
};
use gpuhealth_e2e::{
    client,
    cluster::client_with_token,
    identities::{account_with, rule, token},
    kubectl,
    scenario::{Scenario, WAIT},
    sim::{GpuNodeSpec, gpu_node, node_is_ready},
    unique,
    wait::until,
};
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api,
    api::{DeleteParams, Patch, PatchParams, PostParams},
};
use serde_json::json;

async fn apply(dir: &str) {
    let config = format!("{}/../config/{dir}", env!("CARGO_MANIFEST_DIR"));
    kubectl(&["apply", "--server-side", "-k", &config])
        .await
        .unwrap_or_else(|e| panic!("kubectl apply -k config/{dir}: {e}"));
}

fn record(node: &str) -> GpuNodeHealth {
    serde_json::from_value(json!({
        "apiVersion": "gpuhealth.io/v1alpha1",
        "kind": "GpuNodeHealth",
        "metadata": {"name": node},
        "spec": {},
    }))
    .expect("a record")
}

/// What a forger writes: a reboot in flight on `node`.
fn reboot_in_flight() -> serde_json::Value {
    let incident = "inc-1780000000-0123456789ab";
    let id = RequestId::for_attempt(incident, RecoveryAction::NodeReboot, 1);
    let now = k8s_openapi::jiff::Timestamp::now();
    json!({"status": {
        "phase": "Remediating",
        "incident": incident,
        "action": {
            "id": id.to_string(), "type": "NodeReboot", "attempt": 1,
            "startedAt": now.to_string(), "requestedAt": now.to_string(),
            "deadline": (now + k8s_openapi::jiff::SignedDuration::from_secs(600)).to_string(),
        },
    }})
}

#[tokio::test]
async fn only_the_operator_writes_what_it_acts_on() {
    let admin = client().await.expect("client");
    for dir in ["namespace", "rbac", "admission"] {
        apply(dir).await;
    }
    let node = unique("records");
    let nodes: Api<Node> = Api::all(admin.clone());
    nodes
        .create(
            &PostParams::default(),
            &gpu_node(&node, &node, &GpuNodeSpec::default()),
        )
        .await
        .expect("node");
    until(nodes.clone(), &node, WAIT, node_is_ready)
        .await
        .expect("Ready");

    // An identity with every verb on every resource of gpuhealth.io, as a
    // GitOps controller's wildcard role or a "gpuhealth admin" role has.
    let wildcard = account_with(
        &admin,
        "default",
        &unique("gpuhealth-admin"),
        vec![rule("gpuhealth.io", &["*"], &["*"])],
    )
    .await
    .expect("a wildcard identity");
    let theirs: Api<GpuNodeHealth> = Api::all(wildcard.clone());
    // Once the policy is in force (it loads a moment after it is applied).
    let deadline = Instant::now() + WAIT;
    let refused = loop {
        match theirs.create(&PostParams::default(), &record(&node)).await {
            Err(e) => break e.to_string(),
            Ok(_) => {
                let _ = Api::<GpuNodeHealth>::all(admin.clone())
                    .delete(&node, &DeleteParams::default())
                    .await;
                assert!(Instant::now() < deadline, "the policy never took effect");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    };
    assert!(
        refused.contains("only the gpuhealth operator may write gpunodehealths"),
        "{refused}"
    );

    // The operator's own ServiceAccount writes the record and its status.
    let operator = client_with_token(
        &token(&admin, "gpuhealth-system", "gpuhealth-operator", None)
            .await
            .expect("the operator's token"),
    )
    .await
    .expect("a client as the operator");
    let ours: Api<GpuNodeHealth> = Api::all(operator);
    ours.create(&PostParams::default(), &record(&node))
        .await
        .expect("the operator creates a record");
    ours.patch_status(
        &node,
        &PatchParams::default(),
        &Patch::Merge(json!({"status": {"phase": "Healthy"}})),
    )
    .await
    .expect("and writes its status");

    // The wildcard identity may write none of it: not its status, not its
    // metadata, and it may not delete it.
    let says = |what: &str, r: Result<GpuNodeHealth, kube::Error>| {
        let e = r.expect_err(what).to_string();
        assert!(
            e.contains("only the gpuhealth operator may write gpunodehealths"),
            "{what}: {e}"
        );
    };
    says(
        "a forged status",
        theirs
            .patch_status(
                &node,
                &PatchParams::default(),
                &Patch::Merge(reboot_in_flight()),
            )
            .await,
    );
    says(
        "a changed label",
        theirs
            .patch(
                &node,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {"forged": "yes"}}})),
            )
            .await,
    );
    let e = theirs
        .delete(&node, &DeleteParams::default())
        .await
        .expect_err("a delete");
    assert!(
        e.to_string()
            .contains("only the gpuhealth operator may write gpunodehealths"),
        "{e}"
    );

    // A policy's spec is its author's; its status is the operator's.
    let policies: Api<GpuHealthPolicy> = Api::all(wildcard);
    let name = unique("records-policy");
    let policy: GpuHealthPolicy = serde_json::from_value(json!({
        "apiVersion": "gpuhealth.io/v1alpha1", "kind": "GpuHealthPolicy",
        "metadata": {"name": name},
        "spec": {"mode": "DryRun", "nodeSelector": {"matchLabels": {"records-test": name}}},
    }))
    .expect("a policy");
    policies
        .create(&PostParams::default(), &policy)
        .await
        .expect("an author writes a policy");
    let e = policies
        .patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"nodes": 0}})),
        )
        .await
        .expect_err("its status");
    assert!(
        e.to_string()
            .contains("only the gpuhealth operator may write gpuhealthpolicies/status"),
        "{e}"
    );
    policies
        .delete(&name, &DeleteParams::default())
        .await
        .expect("its author deletes it");
    Api::<GpuNodeHealth>::all(admin.clone())
        .delete(&node, &DeleteParams::default())
        .await
        .expect("cleaned up");
    nodes
        .delete(&node, &DeleteParams::default())
        .await
        .expect("cleaned up");
}

#[tokio::test]
async fn a_record_the_operator_did_not_write_yields_no_request_and_a_finding() {
    let mut s = Scenario::new("forged", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    s.start().await.expect("started");
    let node = s.nodes[0].clone();
    s.wait_status(&node, "Healthy", |st| st.phase == Phase::Healthy)
        .await
        .expect("Healthy");

    // Written by an identity the operator's protection check would not
    // stop (the check is skipped here, as `make demo` runs it; with the
    // install's admission in force, only an identity granted everything
    // gets this far): a reboot in flight on a healthy node. Written again
    // if the operator's own write of the node lands over it first.
    let records: Api<GpuNodeHealth> = Api::all(s.client.clone());
    let forged = FindingKind::ForgedRecord;
    let deadline = Instant::now() + WAIT;
    let status = loop {
        records
            .patch_status(
                &node,
                &PatchParams::default(),
                &Patch::Merge(reboot_in_flight()),
            )
            .await
            .expect("the forged record");
        let seen = s
            .wait_status(
                &node,
                "the ForgedRecord finding, or the forgery overwritten",
                |st| st.findings.iter().any(|f| f.type_ == forged) || st.phase == Phase::Healthy,
            )
            .await
            .expect("a finding");
        if seen.findings.iter().any(|f| f.type_ == forged) {
            break seen;
        }
        assert!(Instant::now() < deadline, "never a finding: {seen:?}");
    };
    assert_eq!(
        status.phase,
        Phase::Remediating,
        "held where it was written"
    );
    s.wait_event(&node, FindingKind::ForgedRecord.as_str())
        .await
        .expect("the Event on the node");
    let metrics = s
        .operator
        .as_ref()
        .expect("operator")
        .scrape()
        .await
        .expect("metrics");
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("gpuhealth_findings_total")
                && l.contains("finding=\"ForgedRecord\"")
                && !l.ends_with(" 0")),
        "{metrics}"
    );
    // The Event is published after the step's actions: had the operator
    // believed the record, its request would be on the node by now; it is
    // not, and past the time a missing request is written again it still
    // is not, and the node is not cordoned.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let n = s.node(&node).await.expect("node");
    let annotations = n.metadata.annotations.clone().unwrap_or_default();
    assert!(
        !annotations.contains_key("gpuhealth.io/reboot-request"),
        "a request for the forged record: {annotations:?}"
    );
    assert_ne!(n.spec.and_then(|s| s.unschedulable), Some(true), "cordoned");

    // Deleted (break glass, here an administrator), the operator starts
    // the node afresh.
    Api::<GpuNodeHealth>::all(s.client.clone())
        .delete(&node, &DeleteParams::default())
        .await
        .expect("the record deleted");
    s.wait_status(&node, "a fresh record", |st| {
        st.phase == Phase::Healthy
            && st
                .findings
                .iter()
                .all(|f| f.type_ != FindingKind::ForgedRecord)
    })
    .await
    .expect("Healthy afresh");
}
