//! Who may write gpuhealth's keys on a Node, with real tokens against the
//! admission policies and RBAC that `config/` ships: an identity that may
//! patch Nodes (as many controllers may) cannot ask for a reset or reboot,
//! touch gpuhealth's cordon record, or write a node's report; the operator
//! can write its keys and not the agent's; break glass only removes, and
//! says so; a broad role over Nodes passes as none of gpuhealth's
//! identities, and one granted everything is not held as the operator; a
//! condition a policy acts on is its writers' alone, and only where the
//! policy acts. And all of it still holds when kustomize moves the install
//! to another namespace and renames it; gpuhealth's device fences likewise.
//!
//! Long because each test applies the shipped install and plays several
//! identities against it, and they share its helpers.

use std::time::{Duration, Instant};

use gpuhealth_api::device_taint_rule::DeviceTaintRule;
use gpuhealth_api::{
    GpuHealthPolicy,
    policy::{ConditionRule, ConditionStatus, ConditionWriter, GpuHealthPolicySpec, Mode},
    types::SignalAction,
};
use gpuhealth_e2e::{
    client,
    cluster::client_with_token,
    dra,
    identities::{account_with, bind, rule, token},
    kubectl, overlay,
    scenario::WAIT,
    sim::{GpuNodeSpec, gpu_node, node_is_ready, remove_node},
    unique,
    wait::{until, until_set},
};
use k8s_openapi::{
    api::{
        core::v1::{Node, Pod},
        rbac::v1::ClusterRoleBinding,
    },
    apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement},
};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, Patch, PatchParams, PostParams},
    runtime::watcher,
};
use serde_json::{Value, json};

fn annotate(key: &str, value: Option<&str>) -> Value {
    json!({"metadata": {"annotations": {key: value}}})
}

/// `Err` with the API server's message when refused.
async fn patch(client: &Client, node: &str, body: Value) -> Result<(), String> {
    Api::<Node>::all(client.clone())
        .patch(node, &PatchParams::default(), &Patch::Merge(body))
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

async fn patch_status(client: &Client, node: &str, body: Value) -> Result<(), String> {
    Api::<Node>::all(client.clone())
        .patch_status(node, &PatchParams::default(), &Patch::Strategic(body))
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

fn gpu_healthy() -> Value {
    condition("GpuHealthy", "False", "Test")
}

/// A status patch writing one condition.
fn condition(type_: &str, status: &str, reason: &str) -> Value {
    json!({"status": {"conditions": [{
        "type": type_, "status": status, "reason": reason, "message": "not from an agent",
        "lastHeartbeatTime": "2026-12-01T00:00:00Z", "lastTransitionTime": "2026-12-01T00:00:00Z",
    }]}})
}

/// What the operator writes of `GpuHealthy` on a node with no report.
fn no_report() -> Value {
    condition(
        "GpuHealthy",
        "Unknown",
        gpuhealth_api::vocabulary::FindingKind::NoReport.as_str(),
    )
}

/// Admission policies load a moment after they are applied (longer on an
/// API server that has just started, as in `make test`): waits until a
/// write of annotation `key` by `client` is refused. Each try writes a new
/// value: a value written before the policy loaded is no change when
/// written again, and the policies let through what changes nothing.
async fn refused_once_in_force(client: &Client, node: &str, key: &str) -> String {
    let deadline = Instant::now() + WAIT;
    for attempt in 0u64.. {
        let value = format!("{{\"attempt\":{attempt}}}");
        match patch(client, node, annotate(key, Some(&value))).await {
            Err(e) => return e,
            Ok(()) => {
                assert!(Instant::now() < deadline, "the policy never took effect");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    }
    unreachable!("a refusal or the deadline ends the loop")
}

/// A client that is the ServiceAccount `namespace/account` of the install.
async fn account_client(admin: &Client, namespace: &str, account: &str) -> Client {
    let token = token(admin, namespace, account, None)
        .await
        .unwrap_or_else(|e| panic!("{namespace}/{account}'s token: {e}"));
    client_with_token(&token)
        .await
        .unwrap_or_else(|e| panic!("a client as {namespace}/{account}: {e}"))
}

async fn apply(dir: &str) {
    let config = format!("{}/../config/{dir}", env!("CARGO_MANIFEST_DIR"));
    kubectl(&["apply", "--server-side", "-k", &config])
        .await
        .unwrap_or_else(|e| panic!("kubectl apply -k config/{dir}: {e}"));
}

/// An on-call identity holding the shipped break-glass role, and the
/// bindings to remove afterwards.
async fn on_call(admin: &Client) -> (Client, [String; 2]) {
    let name = unique("on-call");
    let client = account_with(admin, "default", &name, vec![])
        .await
        .expect("an on-call identity");
    let binding = format!("{name}-break-glass");
    bind(admin, "default", &name, "gpuhealth-break-glass", &binding)
        .await
        .expect("break glass bound");
    (client, [name, binding])
}

async fn ready_node(admin: &Client, name: &str, labels: &[(&str, &str)]) {
    let nodes: Api<Node> = Api::all(admin.clone());
    let mut spec = GpuNodeSpec::default();
    for (k, v) in labels {
        spec.labels.insert((*k).into(), (*v).into());
    }
    nodes
        .create(&PostParams::default(), &gpu_node(name, name, &spec))
        .await
        .expect("node");
    until(nodes, name, WAIT, node_is_ready)
        .await
        .expect("Ready");
}

#[tokio::test]
async fn only_the_operator_asks_and_only_an_agent_reports_whoever_may_patch_nodes() {
    let admin = client().await.expect("client");
    let node = unique("keys");
    ready_node(&admin, &node, &[]).await;
    for dir in ["namespace", "rbac", "admission"] {
        apply(dir).await;
    }
    let (reset, reboot, diagnostics, cordon) = (
        "gpuhealth.io/reset-request",
        "gpuhealth.io/reboot-request",
        "gpuhealth.io/diagnostics-request",
        "gpuhealth.io/cordoned-by",
    );

    // A controller's identity that may patch Nodes and their status.
    let patcher_name = unique("node-patcher");
    let patcher = account_with(
        &admin,
        "default",
        &patcher_name,
        vec![rule("", &["nodes", "nodes/status"], &["get", "patch"])],
    )
    .await
    .expect("a node patcher");
    let e = refused_once_in_force(&patcher, &node, reset).await;
    assert!(
        e.contains("only the gpuhealth operator may write gpuhealth.io/reset-request"),
        "{e}"
    );
    patch(
        &patcher,
        &node,
        json!({"metadata": {"labels": {"team": "ml"}}}),
    )
    .await
    .expect("it may patch Nodes");
    for key in [reboot, diagnostics, cordon] {
        let e = patch(&patcher, &node, annotate(key, Some("{}")))
            .await
            .expect_err(key);
        assert!(
            e.contains(&format!("only the gpuhealth operator may write {key}")),
            "{e}"
        );
    }
    let e = refused_once_in_force(&patcher, &node, "gpuhealth.io/gpus").await;
    assert!(
        e.contains("only a node's gpuhealth agent may write gpuhealth.io/gpus"),
        "{e}"
    );
    let e = patch(
        &patcher,
        &node,
        annotate("gpuhealth.io/request-result", Some("{}")),
    )
    .await
    .expect_err("a request result");
    assert!(e.contains("may write gpuhealth.io/request-result"), "{e}");
    let e = patch_status(&patcher, &node, gpu_healthy())
        .await
        .expect_err("the GpuHealthy condition");
    assert!(e.contains("may write the GpuHealthy condition"), "{e}");
    let e = patch(
        &patcher,
        &node,
        annotate("gpuhealth.io/break-glass", Some("why not")),
    )
    .await
    .expect_err("break glass");
    assert!(e.contains("may write gpuhealth.io/break-glass"), "{e}");

    // The operator's ServiceAccount: its keys, not the agent's.
    let operator = account_client(&admin, "gpuhealth-system", "gpuhealth-operator").await;
    patch(
        &operator,
        &node,
        json!({"metadata": {"annotations": {reset: "{}", cordon: "{}"}}}),
    )
    .await
    .expect("the operator writes a request and its cordon record");
    let e = patch(&operator, &node, annotate("gpuhealth.io/gpus", Some("{}")))
        .await
        .expect_err("the operator writes a report");
    assert!(e.contains("only a node's gpuhealth agent"), "{e}");
    operator_may_say_only_that_no_report_is_there(&admin, &patcher, &operator, &node).await;
    // Nor may the patcher take the operator's away.
    let e = patch(&patcher, &node, annotate(reset, None))
        .await
        .expect_err("removing a request");
    assert!(e.contains("only the gpuhealth operator may write"), "{e}");

    // Break glass: the shipped role bound to an on-call identity.
    let (on_call, on_call_bindings) = on_call(&admin).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    let e = loop {
        let e = patch(&on_call, &node, annotate(reset, None))
            .await
            .expect_err("removing without saying why");
        if e.contains("break glass may only remove") || Instant::now() > deadline {
            break e;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert!(
        e.contains("with gpuhealth.io/break-glass set to the reason"),
        "{e}"
    );
    let e = patch(&on_call, &node, annotate(reboot, Some("{}")))
        .await
        .expect_err("break glass adding a request");
    assert!(e.contains("break glass may only remove"), "{e}");
    patch(
        &on_call,
        &node,
        json!({"metadata": {"annotations": {reset: null, "gpuhealth.io/break-glass": "stuck: agent gone"}}}),
    )
    .await
    .expect("break glass clears the request, saying why");
    // The reason stays until the operator has said so; another write of the
    // node's requests needs a reason of its own.
    let e = patch(&on_call, &node, annotate(cordon, None))
        .await
        .expect_err("a second removal on the first reason");
    assert!(e.contains("break glass may only remove"), "{e}");
    patch(&operator, &node, annotate("gpuhealth.io/break-glass", None))
        .await
        .expect("the operator clears the reason");

    let bindings: Api<ClusterRoleBinding> = Api::all(admin.clone());
    for b in on_call_bindings.iter().chain([&patcher_name]) {
        let _ = bindings.delete(b, &DeleteParams::default()).await;
    }
    remove_node(&admin, &node).await;
}

/// Of a Node's status the operator may write its `GpuHealthy` condition
/// `Unknown` with reason `NoReport`, on a node with no report, and nothing
/// else: not `True` or `False`, not another reason, not where a report is,
/// no other condition or field. Nor may anyone else write that.
async fn operator_may_say_only_that_no_report_is_there(
    admin: &Client,
    patcher: &Client,
    operator: &Client,
    node: &str,
) {
    // The policy applied just now may take a moment to replace one an
    // earlier run left, which refused the operator any of the condition.
    let deadline = Instant::now() + WAIT;
    while let Err(e) = patch_status(operator, node, no_report()).await {
        assert!(Instant::now() < deadline, "never allowed: {e}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    for (status, reason) in [
        ("True", "GpusHealthy"),
        ("False", "GpuUnhealthy"),
        ("Unknown", "Test"),
    ] {
        let e = patch_status(operator, node, condition("GpuHealthy", status, reason))
            .await
            .expect_err(status);
        assert!(
            e.contains("may write the GpuHealthy condition"),
            "{status} {reason}: {e}"
        );
        assert!(
            e.contains("the operator only Unknown, reason NoReport"),
            "{e}"
        );
    }
    let e = patch_status(operator, node, condition("Ready", "False", "Test"))
        .await
        .expect_err("another condition");
    assert!(
        e.contains("may change nothing of a Node's status but"),
        "{e}"
    );
    let capacity = json!({"status": {"capacity": {"nvidia.com/gpu": "64"}}});
    let e = patch_status(operator, node, capacity)
        .await
        .expect_err("capacity");
    assert!(
        e.contains("may change nothing of a Node's status but"),
        "{e}"
    );
    let mut theirs = no_report();
    theirs["status"]["conditions"][0]["message"] = json!("a node patcher's");
    let e = patch_status(patcher, node, theirs)
        .await
        .expect_err("anyone else");
    assert!(e.contains("may write the GpuHealthy condition"), "{e}");
    // Where a report is, not even that.
    patch(admin, node, annotate("gpuhealth.io/gpus", Some("{}")))
        .await
        .expect("a report, as an administrator");
    patch_status(admin, node, condition("GpuHealthy", "True", "GpusHealthy"))
        .await
        .expect("the agent's condition, as an administrator");
    let e = patch_status(operator, node, no_report())
        .await
        .expect_err("Unknown where a report is");
    assert!(e.contains("may write the GpuHealthy condition"), "{e}");
    patch(admin, node, annotate("gpuhealth.io/gpus", None))
        .await
        .expect("the report removed");
}

/// The identities are not what a broad role grants by accident: one account
/// holding a node manager's wildcard role (every verb on Nodes, in every
/// group), every verb on all of gpuhealth.io and every ordinary verb on
/// everything passes neither as the operator nor as an agent's reporter or
/// executor, a notifier or break glass.
#[tokio::test]
async fn broad_roles_pass_as_no_identity_of_gpuhealth() {
    let admin = client().await.expect("client");
    let node = unique("broad");
    ready_node(&admin, &node, &[]).await;
    for dir in ["namespace", "rbac", "admission"] {
        apply(dir).await;
    }
    let name = unique("node-manager");
    let ordinary = [
        "get",
        "list",
        "watch",
        "create",
        "update",
        "patch",
        "delete",
        "deletecollection",
    ];
    let manager = account_with(
        &admin,
        "default",
        &name,
        vec![
            rule("*", &["nodes", "nodes/status"], &["*"]),
            rule("gpuhealth.io", &["*"], &["*"]),
            rule("*", &["*"], &ordinary),
        ],
    )
    .await
    .expect("a node manager");

    let e = refused_once_in_force(&manager, &node, "gpuhealth.io/reset-request").await;
    assert!(e.contains("only the gpuhealth operator may write"), "{e}");
    let e = patch(
        &manager,
        &node,
        annotate("gpuhealth.io/cordoned-by", Some("{}")),
    )
    .await
    .expect_err("the cordon record");
    assert!(e.contains("only the gpuhealth operator may write"), "{e}");
    let e = patch(&manager, &node, annotate("gpuhealth.io/gpus", Some("{}")))
        .await
        .expect_err("a report");
    assert!(e.contains("only a node's gpuhealth agent"), "{e}");
    let e = patch(
        &manager,
        &node,
        annotate("gpuhealth.io/request-result", Some("{}")),
    )
    .await
    .expect_err("a request result");
    assert!(e.contains("only a node's gpuhealth executor"), "{e}");
    let e = patch_status(&manager, &node, gpu_healthy())
        .await
        .expect_err("the GpuHealthy condition");
    assert!(e.contains("may write the GpuHealthy condition"), "{e}");
    let e = patch(
        &manager,
        &node,
        annotate("gpuhealth.io/maintenance", Some("{}")),
    )
    .await
    .expect_err("a maintenance notice");
    assert!(e.contains("only a maintenance notifier"), "{e}");
    let e = patch(
        &manager,
        &node,
        annotate("gpuhealth.io/break-glass", Some("why")),
    )
    .await
    .expect_err("break glass");
    assert!(e.contains("may write gpuhealth.io/break-glass"), "{e}");
    let rules = dra::rules(&manager).await.expect("rules");
    let e = rules
        .create(
            &PostParams::default(),
            &device_rule(&unique("forged"), &node, true).await,
        )
        .await
        .expect_err("a fence of gpuhealth's");
    assert!(
        e.to_string()
            .contains("only the gpuhealth operator may write a DeviceTaintRule"),
        "{e}"
    );
    // What the role is for still works.
    patch(
        &manager,
        &node,
        json!({"metadata": {"labels": {"team": "ml"}}}),
    )
    .await
    .expect("it manages Nodes");

    let bindings: Api<ClusterRoleBinding> = Api::all(admin.clone());
    let _ = bindings.delete(&name, &DeleteParams::default()).await;
    remove_node(&admin, &node).await;
}

/// The label a test's policies select its node by.
const SELECTED: &str = "e2e.gpuhealth.io/selected";

/// The admission policies installed again under names of their own
/// (`nameSuffix: -GROUP`, in namespace GROUP), their guardrail letting
/// policies act on `types`, as a user's overlay over the shipped bases
/// sets it: the ConfigMap patched, config/default's replacements carried.
/// The shared install's guardrail (none) stays as it is for the tests
/// running beside. Its directory, for `kubectl delete -k`.
async fn install_guarding(group: &str, types: &[&str]) -> String {
    let replacements = overlay::shipped_replacements().expect("config/default's replacements");
    let kustomization = format!(
        r#"namespace: {group}
nameSuffix: -{group}
resources:
  - ../../../config/namespace
  - ../../../config/admission
  - ../../../config/operator
patches:
  - target: {{kind: ConfigMap, name: gpuhealth-guardrails}}
    patch: |-
      - op: replace
        path: /data/conditionTypes
        value: "{types}"
  - target: {{kind: Deployment}}
    patch: |-
      - op: replace
        path: /spec/replicas
        value: 0
{replacements}"#,
        types = types.join(",")
    );
    let dir = overlay::write(group, &kustomization).expect("the overlay");
    kubectl(&["apply", "--server-side", "-k", &dir])
        .await
        .expect("the admission policies, guarding the test's types");
    dir
}

/// A policy in `mode` on the nodes `selector` matches, acting on each of
/// `types` as written by `detector` alone. Each must hold an hour before
/// it counts, so that an operator another test runs beside never acts on it.
fn acting_on(
    mode: Mode,
    selector: LabelSelector,
    types: &[&str],
    detector: &str,
) -> GpuHealthPolicySpec {
    let mut spec = GpuHealthPolicySpec::for_selector(selector);
    spec.mode = mode;
    spec.detection.gpu_report.enabled = false;
    spec.detection.node_conditions = types
        .iter()
        .map(|t| ConditionRule {
            type_: (*t).to_owned(),
            status: ConditionStatus::True,
            for_: gpuhealth_api::Duration::from_hours(1),
            action: SignalAction::GpuReset,
            writers: vec![ConditionWriter::service_account("default", detector)],
        })
        .collect();
    spec
}

/// Selects the nodes labelled `SELECTED=value`.
fn selecting(value: &str) -> LabelSelector {
    LabelSelector {
        match_labels: Some([(SELECTED.to_owned(), value.to_owned())].into()),
        ..Default::default()
    }
}

/// A status patch writing condition `type_` True, saying `message`.
fn condition_true(type_: &str, message: &str) -> Value {
    json!({"status": {"conditions": [{
        "type": type_, "status": "True", "reason": "XidSeen", "message": message,
        "lastHeartbeatTime": "2026-12-04T00:00:00Z", "lastTransitionTime": "2026-12-04T00:00:00Z",
    }]}})
}

/// Waits until `client`'s write of condition `type_` on `node` is refused
/// by the install `install_guarding(node, ..)` made for it: its admission
/// policy has the policy acting on it (and every policy created before
/// it) as a parameter. A refusal by another (one a failed run left) is
/// not that. Each try writes something new: a write that changes nothing
/// is let through.
async fn condition_refused_once_in_force(client: &Client, node: &str, type_: &str) -> String {
    let own = format!("'gpuhealth-trusted-conditions-{node}'");
    let deadline = Instant::now() + WAIT;
    loop {
        let forged = format!("forged at {:?}", Instant::now());
        let last = match patch_status(client, node, condition_true(type_, &forged)).await {
            Err(e) if e.contains(&own) => return e,
            Err(e) => e,
            Ok(()) => "let through".to_owned(),
        };
        assert!(
            Instant::now() < deadline,
            "the admission policy never took effect: {last}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// The message of the node's condition `type_`, if it has one.
async fn condition_message(admin: &Client, node: &str, type_: &str) -> Option<String> {
    let node = Api::<Node>::all(admin.clone())
        .get(node)
        .await
        .expect("node");
    node.status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == type_)
        .and_then(|c| c.message)
}

/// A condition a policy acts on is written only by the writers it names:
/// another identity that may patch Nodes' status is refused it (and so
/// changes nothing), as it is a change or removal of the writer's; a
/// condition no policy acts on is anyone's to write.
#[tokio::test]
async fn a_condition_a_policy_acts_on_is_written_only_by_its_writers() {
    let admin = client().await.expect("client");
    gpuhealth_e2e::crds::install(&admin).await.expect("CRDs");
    let node = unique("trusted");
    ready_node(&admin, &node, &[(SELECTED, &node)]).await;
    // A type of this test's own: every policy in the cluster is a
    // parameter of the admission policy.
    let type_ = format!("E2eXid{}", unique("t").replace('-', ""));
    let install = install_guarding(&node, &[&type_]).await;
    let status_writer = vec![rule("", &["nodes", "nodes/status"], &["get", "patch"])];
    let detector_name = unique("detector");
    let detector = account_with(&admin, "default", &detector_name, status_writer.clone())
        .await
        .expect("the detector");
    let other_name = unique("status-patcher");
    let other = account_with(&admin, "default", &other_name, status_writer)
        .await
        .expect("another status writer");
    let policy = unique("trusted");
    let spec = acting_on(Mode::Enforce, selecting(&node), &[&type_], &detector_name);
    let policies: Api<GpuHealthPolicy> = Api::all(admin.clone());
    policies
        .create(&PostParams::default(), &GpuHealthPolicy::new(&policy, spec))
        .await
        .expect("a policy acting on the condition");
    let condition = |status: &str, message: &str| {
        let mut c = condition_true(&type_, message);
        c["status"]["conditions"][0]["status"] = json!(status);
        c
    };

    let e = condition_refused_once_in_force(&other, &node, &type_).await;
    assert!(
        e.contains(&format!(
            "only the writers GpuHealthPolicy {policy} names may write the {type_} condition"
        )),
        "{e}"
    );
    patch_status(
        &detector,
        &node,
        condition("True", "Xid 79 in the kernel log"),
    )
    .await
    .expect("its detector writes it");
    let e = patch_status(&other, &node, condition("False", "cleared by someone else"))
        .await
        .expect_err("another identity changing it");
    assert!(e.contains("only the writers"), "{e}");
    let written = Api::<Node>::all(admin.clone())
        .get(&node)
        .await
        .expect("node");
    let kept = written
        .status
        .and_then(|s| s.conditions)
        .unwrap_or_default()
        .into_iter()
        .find(|c| c.type_ == type_)
        .expect("the condition");
    assert_eq!(
        (kept.status.as_str(), kept.message.as_deref()),
        ("True", Some("Xid 79 in the kernel log"))
    );
    // A condition no policy acts on is anyone's.
    patch_status(
        &other,
        &node,
        json!({"status": {"conditions": [{"type": "E2eUnwatched", "status": "True",
            "lastHeartbeatTime": "2026-12-04T00:00:00Z", "lastTransitionTime": "2026-12-04T00:00:00Z"}]}}),
    )
    .await
    .expect("a condition no policy acts on");

    let _ = policies.delete(&policy, &DeleteParams::default()).await;
    let bindings: Api<ClusterRoleBinding> = Api::all(admin.clone());
    for b in [&detector_name, &other_name] {
        let _ = bindings.delete(b, &DeleteParams::default()).await;
    }
    let _ = kubectl(&["delete", "-k", &install, "--wait=false"]).await;
    remove_node(&admin, &node).await;
}

/// A policy's writers bind only where it acts, so that no policy holds a
/// condition for the whole cluster: on a node its selector matches (before
/// or after the write), in Enforce, for a type the cluster's guardrail lets
/// a policy act on. A DryRun policy, a policy whose selector misses the
/// node and a type the guardrail leaves out refuse nothing there; a write
/// that moves the node's labels out of the selector is still refused.
#[tokio::test]
async fn a_policys_writers_bind_only_where_it_acts() {
    let admin = client().await.expect("client");
    gpuhealth_e2e::crds::install(&admin).await.expect("CRDs");
    let node = unique("acts");
    ready_node(&admin, &node, &[(SELECTED, &node)]).await;
    // The shared install as this build ships it, guarding none of these.
    for dir in ["namespace", "rbac", "admission"] {
        apply(dir).await;
    }
    let prefix = format!("E2e{}", unique("t").replace('-', ""));
    let [enforced, dry_run, missed, unlisted] =
        ["Enforced", "Dry", "Missed", "Unlisted"].map(|t| format!("{prefix}{t}"));
    // Every type but the last allowed by the guardrail.
    let install = install_guarding(&node, &[&enforced, &dry_run, &missed]).await;
    let status_writer = vec![rule("", &["nodes", "nodes/status"], &["get", "patch"])];
    let detector_name = unique("detector");
    account_with(&admin, "default", &detector_name, status_writer.clone())
        .await
        .expect("the detector");
    let other_name = unique("status-patcher");
    let other = account_with(&admin, "default", &other_name, status_writer)
        .await
        .expect("another status writer");

    // The policy that binds last: once its refusal is seen, the API server
    // has the others, created before it, as parameters too.
    let misses = LabelSelector {
        match_expressions: Some(vec![LabelSelectorRequirement {
            key: SELECTED.into(),
            operator: "In".into(),
            values: Some(vec![format!("{node}-not")]),
        }]),
        ..Default::default()
    };
    let names = ["dry-run", "misses", "enforced"].map(|n| unique(&format!("acts-{n}")));
    let specs = [
        acting_on(Mode::DryRun, selecting(&node), &[&dry_run], &detector_name),
        acting_on(Mode::Enforce, misses, &[&missed], &detector_name),
        acting_on(
            Mode::Enforce,
            selecting(&node),
            &[&enforced, &unlisted],
            &detector_name,
        ),
    ];
    let policies: Api<GpuHealthPolicy> = Api::all(admin.clone());
    for (name, spec) in names.iter().zip(specs) {
        policies
            .create(&PostParams::default(), &GpuHealthPolicy::new(name, spec))
            .await
            .expect("a policy");
    }
    let e = condition_refused_once_in_force(&other, &node, &enforced).await;
    assert!(
        e.contains(&format!("names may write the {enforced} condition")),
        "{e}"
    );

    for (type_, why) in [
        (&dry_run, "a DryRun policy's"),
        (&missed, "a policy's whose selector misses the node"),
        (&unlisted, "a type the guardrail does not allow"),
    ] {
        let message = format!("written by another identity: {why}");
        patch_status(&other, &node, condition_true(type_, &message))
            .await
            .unwrap_or_else(|e| panic!("{why} condition refused: {e}"));
        assert_eq!(
            condition_message(&admin, &node, type_).await,
            Some(message),
            "{why}"
        );
    }

    // Out of the selector and the condition in one write: the labels
    // before it count as well as after.
    let mut moving_out = condition_true(&enforced, "written while leaving the selector");
    moving_out["metadata"] = json!({"labels": {SELECTED: format!("{node}-moved")}});
    let e = patch_status(&other, &node, moving_out)
        .await
        .expect_err("a write that moves the node out of the selector");
    assert!(
        e.contains(&format!("names may write the {enforced} condition")),
        "{e}"
    );
    let kept = Api::<Node>::all(admin.clone())
        .get(&node)
        .await
        .expect("node");
    assert_eq!(
        kept.labels().get(SELECTED),
        Some(&node),
        "the node's labels are as they were"
    );

    for name in &names {
        let _ = policies.delete(name, &DeleteParams::default()).await;
    }
    let bindings: Api<ClusterRoleBinding> = Api::all(admin.clone());
    for b in [&detector_name, &other_name] {
        let _ = bindings.delete(b, &DeleteParams::default()).await;
    }
    let _ = kubectl(&["delete", "-k", &install, "--wait=false"]).await;
    remove_node(&admin, &node).await;
}

/// The maintenance notice drains a whole node: an identity that may patch
/// Nodes, and the operator itself, are refused it; the shipped notifier
/// role, once someone binds it, writes and removes it.
#[tokio::test]
async fn only_a_bound_notifier_writes_a_maintenance_notice() {
    let admin = client().await.expect("client");
    let node = unique("notice");
    ready_node(&admin, &node, &[]).await;
    for dir in ["namespace", "rbac", "admission"] {
        apply(dir).await;
    }
    let notice_key = "gpuhealth.io/maintenance";
    let patcher_name = unique("node-patcher");
    let patcher = account_with(
        &admin,
        "default",
        &patcher_name,
        vec![rule("", &["nodes"], &["get", "patch"])],
    )
    .await
    .expect("a node patcher");
    let e = refused_once_in_force(&patcher, &node, notice_key).await;
    assert!(e.contains("only a maintenance notifier"), "{e}");
    let operator = account_client(&admin, "gpuhealth-system", "gpuhealth-operator").await;
    let notice = json!({"deadline": "2026-12-05T08:00:00Z", "source": "cloud-provider",
        "reason": "hardware maintenance"})
    .to_string();
    let e = patch(&operator, &node, annotate(notice_key, Some(&notice)))
        .await
        .expect_err("the operator writing a notice");
    assert!(e.contains("only a maintenance notifier"), "{e}");
    let current = Api::<Node>::all(admin.clone())
        .get(&node)
        .await
        .expect("node");
    assert_ne!(
        current
            .metadata
            .annotations
            .unwrap_or_default()
            .get(notice_key),
        Some(&notice),
        "the operator's notice did not land"
    );

    // The shipped role, bound to a provider's notifier.
    let notifier_name = unique("notifier");
    let notifier = account_with(&admin, "default", &notifier_name, vec![])
        .await
        .expect("a notifier identity");
    let binding = format!("{notifier_name}-notifier");
    bind(
        &admin,
        "default",
        &notifier_name,
        "gpuhealth-maintenance-notifier",
        &binding,
    )
    .await
    .expect("the notifier role bound");
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Err(e) = patch(&notifier, &node, annotate(notice_key, Some(&notice))).await {
        assert!(Instant::now() < deadline, "the notifier refused: {e}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    patch(&notifier, &node, annotate(notice_key, None))
        .await
        .expect("the notifier withdraws its notice");
    let e = patch(
        &notifier,
        &node,
        annotate("gpuhealth.io/reset-request", Some("{}")),
    )
    .await
    .expect_err("the notifier writing a request");
    assert!(e.contains("only the gpuhealth operator"), "{e}");

    let bindings: Api<ClusterRoleBinding> = Api::all(admin.clone());
    for b in [&patcher_name, &notifier_name, &binding] {
        let _ = bindings.delete(b, &DeleteParams::default()).await;
    }
    remove_node(&admin, &node).await;
}

/// kustomize's `namespace:` and `nameSuffix:` over the shipped install: the
/// policies know the operator and the agent by their RBAC, which moves with
/// them, so a rename neither lets others in nor locks gpuhealth out.
#[tokio::test]
async fn the_policies_follow_the_install_into_another_namespace() {
    let admin = client().await.expect("client");
    let group = unique("elsewhere");
    let (own, other) = (format!("{group}-own"), format!("{group}-other"));
    ready_node(&admin, &own, &[("e2e.gpuhealth.io/elsewhere", &group)]).await;
    ready_node(&admin, &other, &[]).await;
    gpuhealth_e2e::sim::gpu_operator_runtime_class(&admin)
        .await
        .expect("the nvidia RuntimeClass");

    // The overlay a user would write, with the agent kept to this test's node.
    let namespace = group.clone();
    let kustomization = format!(
        r#"namespace: {namespace}
nameSuffix: -moved
resources:
  - ../../../config/namespace
  - ../../../config/rbac
  - ../../../config/admission
  - ../../../config/agent/container-toolkit
patches:
  - target: {{kind: DaemonSet}}
    patch: |-
      - op: replace
        path: /spec/template/spec/nodeSelector
        value: {{e2e.gpuhealth.io/elsewhere: "{group}"}}
"#
    );
    let dir = overlay::write(&group, &kustomization).expect("the overlay");
    kubectl(&["apply", "--server-side", "-k", &dir])
        .await
        .expect("the moved install");

    // The moved reporter's pod on its node, and a token bound to it.
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &namespace);
    let on_own = until_set(
        pods,
        watcher::Config::default()
            .fields(&format!("spec.nodeName={own}"))
            .labels("app.kubernetes.io/name=gpuhealth-agent"),
        "the moved agent's pod on its node",
        WAIT,
        |set| !set.is_empty(),
    )
    .await
    .expect("agent pod");
    let pod = on_own.values().next().expect("pod").clone();
    let agent = client_with_token(
        &token(&admin, &namespace, "gpuhealth-agent-moved", Some(&pod))
            .await
            .expect("the moved agent's token"),
    )
    .await
    .expect("agent client");
    let report = annotate("gpuhealth.io/gpus", Some("{\"version\":1}"));
    let e = refused_once_in_force(&agent, &other, "gpuhealth.io/gpus").await;
    assert!(e.contains("only the Node it runs on"), "{e}");
    patch(&agent, &own, report).await.expect("its own report");
    let e = patch(
        &agent,
        &own,
        annotate("gpuhealth.io/reset-request", Some("{}")),
    )
    .await
    .expect_err("the moved agent asks for a reset");
    // Refused by both policies; either may answer first.
    assert!(
        e.contains("only the gpuhealth operator may write")
            || e.contains("the gpuhealth agent may change only"),
        "{e}"
    );

    let operator = account_client(&admin, &namespace, "gpuhealth-operator-moved").await;
    patch(
        &operator,
        &own,
        annotate("gpuhealth.io/reset-request", Some("{}")),
    )
    .await
    .expect("the moved operator asks for a reset");

    // The renamed operator is still held to telling a pod it leaves.
    let pod = workload_pod(&admin, &namespace, &other).await;
    let e = image_change_refused_once_in_force(&operator, &namespace, &pod).await;
    assert!(
        e.contains("the gpuhealth operator may change nothing of a pod but"),
        "{e}"
    );
    Api::<Pod>::namespaced(operator.clone(), &namespace)
        .patch(
            &pod,
            &PatchParams::default(),
            &Patch::Merge(annotate(
                "gpuhealth.io/evict-at",
                Some("2026-12-05T00:00:00Z"),
            )),
        )
        .await
        .expect("the moved operator tells a pod it leaves with its gang");

    kubectl(&["delete", "-k", &dir, "--wait=false"])
        .await
        .expect("remove the moved install");
    for n in [&own, &other] {
        remove_node(&admin, n).await;
    }
}

/// A pod of a workload's in `namespace` on `node`; its name.
async fn workload_pod(admin: &Client, namespace: &str, node: &str) -> String {
    let name = unique("workload");
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"nodeName": node, "containers": [{"name": "server", "image": "vllm:1"}]},
    }))
    .expect("a pod");
    Api::<Pod>::namespaced(admin.clone(), namespace)
        .create(&PostParams::default(), &pod)
        .await
        .expect("a workload's pod");
    name
}

/// A patch of a pod's image.
fn image(to: &str) -> Value {
    json!({"spec": {"containers": [{"name": "server", "image": to}]}})
}

/// Waits until `client`'s change of `pod`'s image is refused (the pods'
/// policy loads a moment after it is applied); the refusal. Each try asks
/// for a new image: a write that changes nothing is let through.
async fn image_change_refused_once_in_force(client: &Client, namespace: &str, pod: &str) -> String {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let deadline = Instant::now() + WAIT;
    for attempt in 0u64.. {
        let to = image(&format!("evil:{attempt}"));
        match pods
            .patch(pod, &PatchParams::default(), &Patch::Strategic(to))
            .await
        {
            Err(e) => return e.to_string(),
            Ok(_) => {
                assert!(
                    Instant::now() < deadline,
                    "the pods' policy never took effect"
                );
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    }
    unreachable!("a refusal or the deadline ends the loop")
}

/// The pods' policy knows the operator by its RBAC, not by its name, and
/// holds the operator alone: an identity granted every verb on everything
/// (cluster-admin, as a GitOps controller's ServiceAccount often is) also
/// passes as the operator, and is not held to a gang's notice.
#[tokio::test]
async fn an_identity_granted_everything_is_not_held_to_the_operators_pod_rights() {
    let admin = client().await.expect("client");
    let node = unique("everything");
    ready_node(&admin, &node, &[]).await;
    for dir in ["namespace", "rbac", "admission"] {
        apply(dir).await;
    }
    let operator = account_client(&admin, "gpuhealth-system", "gpuhealth-operator").await;
    let pod = workload_pod(&admin, "default", &node).await;
    let e = image_change_refused_once_in_force(&operator, "default", &pod).await;
    assert!(
        e.contains("the gpuhealth operator may change nothing of a pod but"),
        "{e}"
    );

    let name = unique("gitops");
    let gitops = account_with(&admin, "default", &name, vec![])
        .await
        .expect("a controller's identity");
    let binding = format!("{name}-cluster-admin");
    bind(&admin, "default", &name, "cluster-admin", &binding)
        .await
        .expect("cluster-admin bound");
    let pods: Api<Pod> = Api::namespaced(gitops.clone(), "default");
    // RBAC takes a new binding in a moment.
    let deadline = Instant::now() + WAIT;
    while let Err(e) = pods
        .patch(
            &pod,
            &PatchParams::default(),
            &Patch::Strategic(image("vllm:2")),
        )
        .await
    {
        assert!(
            !e.to_string().contains("gpuhealth operator") && Instant::now() < deadline,
            "cluster-admin's identity changing a pod's image: {e}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    pods.delete(&pod, &DeleteParams::default())
        .await
        .expect("cluster-admin's identity deletes a pod nobody told");

    let bindings: Api<ClusterRoleBinding> = Api::all(admin.clone());
    for b in [&name, &binding] {
        let _ = bindings.delete(b, &DeleteParams::default()).await;
    }
    remove_node(&admin, &node).await;
}

/// Break glass with the real operator: a reset request nobody answers is
/// removed by an on-call identity holding the shipped role, with a reason.
/// The operator abandons the attempt (never re-issued), leaves the node
/// Failed and cordoned, and makes the use visible: an Event with the reason,
/// and `gpuhealth_findings_total{finding="BreakGlass"}`.
#[tokio::test]
async fn break_glass_clears_a_stuck_request_and_is_seen() {
    use gpuhealth_api::{
        node_health::Phase,
        vocabulary::{FindingKind, Reason},
    };
    use gpuhealth_e2e::{operator, scenario::Scenario};

    let admin = client().await.expect("client");
    apply("admission").await;
    let mut s = Scenario::new("glass", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    // No agent: the request stays unanswered.
    s.operator = Some(
        operator::start_with(&format!("operator-{}", s.group), s.operator_options.clone())
            .await
            .expect("operator"),
    );
    s.wait_taken_in().await.expect("taken in");
    s.break_gpu(&node, 7).await.expect("break");
    let nodes: Api<Node> = Api::all(admin.clone());
    let reset = "gpuhealth.io/reset-request";
    until(nodes.clone(), &node, WAIT, |n| {
        n.metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(reset))
    })
    .await
    .expect("a reset request on the node");

    let (on_call, on_call_bindings) = on_call(&admin).await;
    let clear = json!({"metadata": {"annotations": {
        reset: null, "gpuhealth.io/break-glass": "agent gone, node to be reimaged",
    }}});
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Err(e) = patch(&on_call, &node, clear.clone()).await {
        assert!(Instant::now() < deadline, "break glass refused: {e}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    let status = s
        .wait_status(&node, "Failed by break glass", |st| {
            st.phase == Phase::Failed && st.reason == Some(Reason::BreakGlass)
        })
        .await
        .expect("Failed, BreakGlass");
    assert!(
        status
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("agent gone"),
        "{status:?}"
    );
    s.wait_event_saying(
        &node,
        FindingKind::BreakGlass.as_str(),
        "agent gone, node to be reimaged",
    )
    .await
    .expect("the Event");
    let n = until(nodes.clone(), &node, WAIT, |n| {
        !n.metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key("gpuhealth.io/break-glass"))
    })
    .await
    .expect("the reason removed once recorded");
    assert!(
        n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true),
        "left cordoned"
    );
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
                && l.contains("finding=\"BreakGlass\"")
                && !l.ends_with(" 0")),
        "{metrics}"
    );
    // Past the time a missing request would be written again: it is not.
    tokio::time::sleep(Duration::from_secs(8)).await;
    let n = nodes.get(&node).await.expect("node");
    assert!(
        !n.metadata
            .annotations
            .unwrap_or_default()
            .contains_key(reset),
        "the abandoned request was written again"
    );
    let bindings: Api<ClusterRoleBinding> = Api::all(admin.clone());
    for b in &on_call_bindings {
        let _ = bindings.delete(b, &DeleteParams::default()).await;
    }
}

/// A DeviceTaintRule fencing GPU 7 of `node`, with gpuhealth's label or
/// not, in the version the cluster serves.
async fn device_rule(name: &str, node: &str, ours: bool) -> DeviceTaintRule {
    let version = dra::rule_version(&client().await.expect("client"))
        .await
        .expect("the cluster serves DeviceTaintRules");
    let mut labels = serde_json::Map::new();
    if ours {
        labels.insert("app.kubernetes.io/managed-by".into(), json!("gpuhealth"));
    }
    serde_json::from_value(json!({
        "apiVersion": version.group_version(),
        "kind": "DeviceTaintRule",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "deviceSelector": {"driver": "gpu.nvidia.com", "pool": node, "device": "gpu-7"},
            "taint": {"key": "example.com/held", "effect": "NoSchedule"},
        },
    }))
    .expect("a rule")
}

#[tokio::test]
async fn only_the_operator_writes_or_lifts_its_device_fences() {
    let admin = client().await.expect("client");
    for dir in ["namespace", "rbac", "admission"] {
        apply(dir).await;
    }
    let node = unique("fence");
    let admins = dra::rules(&admin).await.expect("rules");
    // A DRA administrator's identity: it may write any DeviceTaintRule.
    let dra_admin_name = unique("dra-admin");
    let dra_admin = account_with(
        &admin,
        "default",
        &dra_admin_name,
        vec![rule(
            "resource.k8s.io",
            &["devicetaintrules"],
            &["get", "create", "delete"],
        )],
    )
    .await
    .expect("a DRA administrator");
    let rules = dra::rules(&dra_admin).await.expect("rules");

    // Its own rules, as ever.
    let theirs = format!("{node}-theirs");
    rules
        .create(
            &PostParams::default(),
            &device_rule(&theirs, &node, false).await,
        )
        .await
        .expect("an unlabelled rule");
    rules
        .delete(&theirs, &DeleteParams::default())
        .await
        .expect("and deleted");

    // Not one that claims to be gpuhealth's (once the policy is in force).
    let forged = format!("{node}-forged");
    let deadline = Instant::now() + WAIT;
    let e = loop {
        match rules
            .create(
                &PostParams::default(),
                &device_rule(&forged, &node, true).await,
            )
            .await
        {
            Err(e) => break e.to_string(),
            Ok(_) => {
                let _ = admins.delete(&forged, &DeleteParams::default()).await;
                assert!(Instant::now() < deadline, "the policy never took effect");
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    };
    assert!(
        e.contains("only the gpuhealth operator may write a DeviceTaintRule"),
        "{e}"
    );

    // The operator's ServiceAccount writes one; the DRA administrator may
    // not lift it; break glass may.
    let operator = account_client(&admin, "gpuhealth-system", "gpuhealth-operator").await;
    let fence = format!("gpuhealth-{node}-gpu-7");
    dra::rules(&operator)
        .await
        .expect("rules")
        .create(
            &PostParams::default(),
            &device_rule(&fence, &node, true).await,
        )
        .await
        .expect("the operator fences a GPU");
    let e = rules
        .delete(&fence, &DeleteParams::default())
        .await
        .expect_err("someone else lifts gpuhealth's fence");
    assert!(
        e.to_string()
            .contains("only the gpuhealth operator may write a DeviceTaintRule"),
        "{e}"
    );
    // The shipped break-glass role alone lifts it, as docs/security.md says.
    let (on_call, on_call_bindings) = on_call(&admin).await;
    let on_call_rules = dra::rules(&on_call).await.expect("rules");
    let deadline = Instant::now() + WAIT;
    while let Err(e) = on_call_rules.delete(&fence, &DeleteParams::default()).await {
        assert!(Instant::now() < deadline, "break glass lifts a fence: {e}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    let bindings: Api<ClusterRoleBinding> = Api::all(admin.clone());
    for b in on_call_bindings.iter().chain([&dra_admin_name]) {
        let _ = bindings.delete(b, &DeleteParams::default()).await;
    }
}

/// Each write that would forge a trigger gpuhealth acts on is refused and
/// seen: the API server's own audit log holds the refusal, annotated
/// `validation.policy.admission.k8s.io/validation_failure` with the policy
/// that refused it. The lanes this file runs in start their cluster with
/// the audit log (`GPUHEALTH_CLUSTER_AUDIT=1`, e2e/lanes.sh).
#[tokio::test]
async fn each_refused_forgery_is_in_the_audit_log_naming_its_policy() {
    let admin = client().await.expect("client");
    let kubeconfig = gpuhealth_e2e::cluster::kubeconfig_path()
        .await
        .expect("the cluster's kubeconfig");
    let log = gpuhealth_e2e::audit::log_beside(&kubeconfig);
    assert!(
        log.exists(),
        "no audit log at {}: this test needs the cluster started with GPUHEALTH_CLUSTER_AUDIT=1, as e2e/lanes.sh starts it",
        log.display()
    );
    gpuhealth_e2e::crds::install(&admin).await.expect("CRDs");
    for dir in ["namespace", "rbac", "admission"] {
        apply(dir).await;
    }
    let node = unique("audited");
    ready_node(&admin, &node, &[(SELECTED, &node)]).await;
    // A condition a policy acts on: guarded by an install of its own.
    let type_ = format!("E2eXid{}", unique("t").replace('-', ""));
    let install = install_guarding(&node, &[&type_]).await;
    let policy = unique("audited");
    Api::<GpuHealthPolicy>::all(admin.clone())
        .create(
            &PostParams::default(),
            &GpuHealthPolicy::new(
                &policy,
                acting_on(Mode::Enforce, selecting(&node), &[&type_], "a-detector"),
            ),
        )
        .await
        .expect("a policy acting on the condition");

    // Whoever may patch Nodes, their status, and everything of gpuhealth.io.
    let forger_name = unique("forger");
    let forger = account_with(
        &admin,
        "default",
        &forger_name,
        vec![
            rule("", &["nodes", "nodes/status"], &["get", "patch"]),
            rule("gpuhealth.io", &["*"], &["*"]),
        ],
    )
    .await
    .expect("the forger");
    let username = format!("system:serviceaccount:default:{forger_name}");

    // Each forgery, refused: (the resource and subresource written, the
    // policy that refuses it).
    let mut refused: Vec<(&str, &str, String)> = Vec::new();
    for key in [
        "gpuhealth.io/reset-request",
        "gpuhealth.io/cordoned-by",
        "gpuhealth.io/gpus",
        "gpuhealth.io/request-result",
        "gpuhealth.io/maintenance",
    ] {
        let e = refused_once_in_force(&forger, &node, key).await;
        let by = if key.contains("request-result") || key.contains("gpus") {
            "gpuhealth-agent-keys"
        } else if key.contains("maintenance") {
            "gpuhealth-maintenance-notice"
        } else {
            "gpuhealth-operator-keys"
        };
        assert!(e.contains(by), "{key}: {e}");
        refused.push(("nodes", "", by.to_owned()));
    }
    let e = patch_status(&forger, &node, gpu_healthy())
        .await
        .expect_err("GpuHealthy");
    assert!(e.contains("gpuhealth-agent-keys"), "{e}");
    refused.push(("nodes", "status", "gpuhealth-agent-keys".into()));
    let e = condition_refused_once_in_force(&forger, &node, &type_).await;
    let trusted = format!("gpuhealth-trusted-conditions-{node}");
    assert!(e.contains(&trusted), "{e}");
    refused.push(("nodes", "status", trusted));
    let record: gpuhealth_api::GpuNodeHealth = serde_json::from_value(json!({
        "apiVersion": "gpuhealth.io/v1alpha1", "kind": "GpuNodeHealth",
        "metadata": {"name": node}, "spec": {},
    }))
    .expect("a record");
    let e = Api::<gpuhealth_api::GpuNodeHealth>::all(forger.clone())
        .create(&PostParams::default(), &record)
        .await
        .expect_err("a GpuNodeHealth")
        .to_string();
    assert!(e.contains("gpuhealth-operator-records"), "{e}");
    refused.push(("gpunodehealths", "", "gpuhealth-operator-records".into()));

    // The log is written as each request ends; read until all are there.
    let deadline = Instant::now() + WAIT;
    loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let refusals: Vec<Value> = text
            .lines()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|e| {
                // A create names its object in its body, not its path: the
                // log leaves its name out.
                let name = &e["objectRef"]["name"];
                e["user"]["username"] == json!(username)
                    && (*name == json!(node) || name.is_null())
                    && e["responseStatus"]["code"]
                        .as_u64()
                        .is_some_and(|c| c >= 400)
            })
            .collect();
        let missing: Vec<&(&str, &str, String)> = refused
            .iter()
            .filter(|(resource, sub, by)| {
                !refusals.iter().any(|e| {
                    e["objectRef"]["resource"] == json!(resource)
                        && e["objectRef"]["subresource"].as_str().unwrap_or("") == *sub
                        && e["annotations"]["validation.policy.admission.k8s.io/validation_failure"]
                            .as_str()
                            // The shared install's policy, or its copy in
                            // the test's own install (`install_guarding`).
                            .is_some_and(|f| f.contains(&format!("\"policy\":\"{by}")))
                })
            })
            .collect();
        if missing.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "refusals not in the audit log, annotated with their policy: {missing:?}; the forger's refusals there: {refusals:#?}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }

    let _ = Api::<GpuHealthPolicy>::all(admin.clone())
        .delete(&policy, &DeleteParams::default())
        .await;
    let _ = Api::<ClusterRoleBinding>::all(admin.clone())
        .delete(&forger_name, &DeleteParams::default())
        .await;
    let _ = kubectl(&["delete", "-k", &install, "--wait=false"]).await;
    remove_node(&admin, &node).await;
}
