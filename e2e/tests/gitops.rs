//! The Argo CD health checks in config/argocd: the Lua runs in Lua 5.1 (the
//! language of Argo CD's gopher-lua) on objects built from the Rust types
//! the operator writes, and the Component merges both scripts into an
//! `argocd-cm` that kustomize builds.

use gpuhealth_api::{
    GpuHealthPolicy, GpuHealthPolicySpec, GpuHealthPolicyStatus, GpuNodeHealth, GpuNodeHealthSpec,
    GpuNodeHealthStatus, node_health::Phase, policy::Mode,
};
use gpuhealth_e2e::kubectl;
use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
    jiff::Timestamp,
};
use mlua::{Lua, LuaSerdeExt, Table};
use serde::Serialize;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/argocd");

fn script(file: &str) -> String {
    std::fs::read_to_string(format!("{ROOT}/{file}")).expect(file)
}

/// Runs a health script as Argo CD does: the object in the global `obj`,
/// the result a table with `status` and `message`.
fn health(file: &str, object: &impl Serialize) -> (String, String) {
    let lua = Lua::new();
    let value = serde_json::to_value(object).expect("JSON");
    let obj = lua.to_value(&value).expect("a Lua table");
    lua.globals().set("obj", obj).expect("obj");
    let hs: Table = lua
        .load(script(file))
        .set_name(file)
        .eval()
        .unwrap_or_else(|e| panic!("{file} failed: {e}"));
    let status: String = hs.get("status").expect("status");
    let message: String = hs.get("message").expect("message");
    (status, message)
}

fn condition(type_: &str, status: bool, message: &str) -> Condition {
    Condition {
        type_: type_.into(),
        status: if status { "True" } else { "False" }.into(),
        reason: "Test".into(),
        message: message.into(),
        last_transition_time: Time(Timestamp::UNIX_EPOCH),
        observed_generation: Some(2),
    }
}

fn policy(mode: Mode, status: Option<GpuHealthPolicyStatus>) -> GpuHealthPolicy {
    let mut spec = GpuHealthPolicySpec::for_selector(Default::default());
    spec.mode = mode;
    let mut policy = GpuHealthPolicy::new("gpu-nodes", spec);
    policy.metadata.generation = Some(2);
    policy.status = status;
    policy
}

fn policy_status(conditions: Vec<Condition>) -> GpuHealthPolicyStatus {
    GpuHealthPolicyStatus {
        observed_generation: Some(2),
        nodes: 3,
        healthy: 2,
        remediating: 1,
        failed: 0,
        conditions,
    }
}

fn fine() -> Vec<Condition> {
    vec![
        condition("Ready", true, "managing 3 node(s)"),
        condition("CircuitOpen", false, "1 of at most 1 nodes unhealthy"),
        condition("Conflict", false, "no other policy manages a node"),
    ]
}

#[test]
fn a_policy_is_healthy_while_it_does_its_job() {
    let file = "gpuhealthpolicy.lua";
    let (status, message) = health(file, &policy(Mode::Enforce, Some(policy_status(fine()))));
    assert_eq!(status, "Healthy");
    assert_eq!(message, "3 nodes: 2 healthy, 1 remediating, 0 failed");

    let (status, message) = health(file, &policy(Mode::DryRun, Some(policy_status(fine()))));
    assert_eq!(status, "Healthy");
    assert!(message.starts_with("DryRun: recording plans"), "{message}");

    let (status, message) = health(file, &policy(Mode::Paused, Some(policy_status(fine()))));
    assert_eq!(status, "Suspended");
    assert!(message.starts_with("Paused"), "{message}");
}

#[test]
fn a_policy_not_yet_read_is_progressing() {
    let file = "gpuhealthpolicy.lua";
    let (status, _) = health(file, &policy(Mode::Enforce, None));
    assert_eq!(status, "Progressing");
    let mut stale = policy_status(fine());
    stale.observed_generation = Some(1);
    let (status, message) = health(file, &policy(Mode::Enforce, Some(stale)));
    assert_eq!(status, "Progressing");
    assert!(message.contains("generation"), "{message}");
}

#[test]
fn an_invalid_open_or_overlapping_policy_is_degraded() {
    let file = "gpuhealthpolicy.lua";
    let cases = [
        ("Ready", false, "nodeSelector cannot be used"),
        ("CircuitOpen", true, "5 nodes are unhealthy"),
        ("Conflict", true, "nodes this policy selects are managed by"),
    ];
    for (type_, value, text) in cases {
        let mut conditions = fine();
        conditions.retain(|c| c.type_ != type_);
        conditions.push(condition(type_, value, text));
        let (status, message) = health(
            file,
            &policy(Mode::Enforce, Some(policy_status(conditions))),
        );
        assert_eq!(status, "Degraded", "{type_}={value}");
        assert!(message.contains(text), "{type_}: {message}");
    }
}

fn node_health(status: Option<GpuNodeHealthStatus>) -> GpuNodeHealth {
    let mut node = GpuNodeHealth::new("gpu-node-07", GpuNodeHealthSpec {});
    node.status = status;
    node
}

#[test]
fn a_node_is_healthy_progressing_or_degraded_by_its_phase() {
    let file = "gpunodehealth.lua";
    let (status, _) = health(file, &node_health(None));
    assert_eq!(status, "Progressing");
    for phase in Phase::ALL {
        let (status, message) = health(
            file,
            &node_health(Some(GpuNodeHealthStatus {
                phase,
                reason: Some(gpuhealth_api::vocabulary::Reason::Xid),
                message: Some("Xid 119 on GPU 7".into()),
                ..Default::default()
            })),
        );
        let expected = match phase {
            Phase::Healthy => "Healthy",
            Phase::Failed => "Degraded",
            _ => "Progressing",
        };
        assert_eq!(status, expected, "{phase:?}");
        assert!(
            message.contains("(Xid): Xid 119 on GPU 7"),
            "{phase:?}: {message}"
        );
    }
}

/// Added to the kustomization that installs Argo CD (shaped like Argo CD's
/// own: its manifests name no namespace, the kustomization sets it), the
/// Component merges both checks into `argocd-cm`, keeping what is there.
#[tokio::test]
async fn the_component_merges_both_checks_into_argocd_cm() {
    let dir = std::env::temp_dir().join(gpuhealth_e2e::names::unique("argocd"));
    std::fs::create_dir_all(&dir).expect("dir");
    std::fs::write(
        dir.join("argocd-cm.yaml"),
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: argocd-cm\ndata:\n  url: https://argocd.example.com\n",
    )
    .expect("argocd-cm");
    // Kustomize takes only relative paths: from the directory up to / and down.
    let root = std::fs::canonicalize(ROOT).expect("config/argocd");
    let up = "../".repeat(dir.components().count() - 1);
    let component = format!("{up}{}", root.to_string_lossy().trim_start_matches('/'));
    std::fs::write(
        dir.join("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nnamespace: argocd\nresources:\n  - argocd-cm.yaml\ncomponents:\n  - {component}\n"
        ),
    )
    .expect("kustomization");
    let built = kubectl(&["kustomize", &dir.to_string_lossy()])
        .await
        .expect("kubectl kustomize");
    let cm: serde_json::Value = serde_yaml::from_str(&built).expect("one ConfigMap");
    assert_eq!(cm["metadata"]["name"], "argocd-cm");
    assert_eq!(cm["metadata"]["namespace"], "argocd");
    let data = &cm["data"];
    assert_eq!(data["url"], "https://argocd.example.com", "kept");
    for (kind, file) in [
        ("GpuHealthPolicy", "gpuhealthpolicy.lua"),
        ("GpuNodeHealth", "gpunodehealth.lua"),
    ] {
        assert_eq!(
            data[format!("resource.customizations.health.gpuhealth.io_{kind}")],
            script(file),
            "{kind}'s check is the script, verbatim"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
