//! The API against a real kube-apiserver: the CRDs install and become
//! Established, a minimal policy is stored with every default filled in, and
//! invalid policies are refused with a message that names the field.
//!
//! Long because each test is one scenario against a real API server, and
//! they share the CRDs' setup.

use gpuhealth_api::{
    GpuHealthPolicy, GpuHealthPolicySpec, GpuNodeHealth,
    node_health::{ActionStatus, GpuNodeHealthStatus, Phase},
    policy::GpuHealthPolicyStatus,
    types::RecoveryAction,
    vocabulary::{QuarantineWhy, Reason},
};
use gpuhealth_e2e::{client, crds, kubectl, unique};
use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::{LabelSelector, Time},
    jiff::Timestamp,
};
use kube::{
    Api, Client,
    api::{ApiResource, DynamicObject, Patch, PatchParams, PostParams},
    core::GroupVersionKind,
};
use serde_json::{Value, json};

async fn setup() -> Client {
    let client = client().await.expect("test cluster");
    crds::install(&client)
        .await
        .expect("CRDs install and become Established");
    client
}

fn policies(client: &Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk(
        gpuhealth_api::GROUP,
        gpuhealth_api::VERSION,
        "GpuHealthPolicy",
    );
    Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(&gvk, "gpuhealthpolicies"),
    )
}

fn policy(name: &str, spec: Value) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "gpuhealth.io/v1alpha1",
        "kind": "GpuHealthPolicy",
        "metadata": {"name": name},
        "spec": spec,
    }))
    .expect("well-formed object")
}

#[tokio::test]
async fn minimal_policy_is_stored_with_its_defaults() {
    let client = setup().await;
    let name = unique("minimal");
    let selector = json!({"matchLabels": {"nvidia.com/gpu.present": "true"}});
    policies(&client)
        .create(
            &PostParams::default(),
            &policy(&name, json!({"nodeSelector": selector})),
        )
        .await
        .expect("a policy with only a nodeSelector is accepted");

    // Compare the raw stored JSON, not a typed read: serde defaults on our
    // side would hide a default the API server failed to apply.
    let stored = policies(&client).get(&name).await.expect("read back");
    let selector: LabelSelector = serde_json::from_value(selector).expect("selector");
    let expected =
        serde_json::to_value(GpuHealthPolicySpec::for_selector(selector)).expect("serialise");
    assert_eq!(
        stored.data["spec"], expected,
        "the API server fills in every default"
    );
    assert_eq!(stored.data["spec"]["mode"], "Enforce");
    assert_eq!(stored.data["spec"]["maxConcurrent"], 1);
    assert_eq!(stored.data["spec"]["maxUnhealthy"], "25%");
    assert_eq!(stored.data["spec"]["escalation"][0]["action"], "GpuReset");
    assert_eq!(stored.data["spec"]["escalation"][1]["action"], "NodeReboot");
    assert_eq!(stored.data["spec"]["drain"]["scope"], "AffectedPods");

    // And the typed client reads it.
    let typed: GpuHealthPolicy = Api::all(client.clone())
        .get(&name)
        .await
        .expect("typed read");
    assert_eq!(typed.spec.escalation.len(), 2);
    // It selects every GPU node: left behind, it would manage the nodes
    // of every later test.
    policies(&client)
        .delete(&name, &Default::default())
        .await
        .expect("clean up");
}

/// Each case: a description, a spec that is invalid in exactly one way, and
/// the field the refusal must name.
fn invalid_policies() -> Vec<(&'static str, Value, &'static str)> {
    let sel = json!({"matchLabels": {"gpu": "true"}});
    let with = |extra: Value| {
        let mut spec = json!({"nodeSelector": sel});
        if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
            s.extend(e.clone());
        }
        spec
    };
    vec![
        (
            "no nodeSelector",
            json!({"mode": "Enforce"}),
            "spec.nodeSelector",
        ),
        ("unknown mode", with(json!({"mode": "Yolo"})), "spec.mode"),
        (
            "priority out of range",
            with(json!({"priority": 5000})),
            "spec.priority",
        ),
        (
            "empty escalation",
            with(json!({"escalation": []})),
            "spec.escalation",
        ),
        (
            "repeated rung",
            with(json!({"escalation": [{"action": "GpuReset"}, {"action": "GpuReset"}]})),
            "spec.escalation[1]",
        ),
        (
            "rungs out of order",
            with(json!({"escalation": [{"action": "NodeReboot"}, {"action": "GpuReset"}]})),
            "spec.escalation",
        ),
        (
            "unknown action",
            with(json!({"escalation": [{"action": "Explode"}]})),
            "spec.escalation[0].action",
        ),
        (
            "zero attempts",
            with(json!({"escalation": [{"action": "GpuReset", "attempts": 0}]})),
            "spec.escalation[0].attempts",
        ),
        (
            "zero rung timeout",
            with(json!({"escalation": [{"action": "GpuReset", "timeout": "0s"}]})),
            "spec.escalation[0].timeout",
        ),
        (
            "malformed duration",
            with(json!({"drain": {"timeout": "ten minutes"}})),
            "spec.drain.timeout",
        ),
        (
            "hostile duration",
            with(json!({"drain": {"timeout": "1e400h"}})),
            "spec.drain.timeout",
        ),
        (
            "zero drain timeout",
            with(json!({"drain": {"timeout": "0s"}})),
            "spec.drain.timeout",
        ),
        (
            "grace longer than drain timeout",
            with(json!({"drain": {"timeout": "5m", "gracePeriod": "10m"}})),
            "drain.gracePeriod",
        ),
        (
            "unknown drain scope",
            with(json!({"drain": {"scope": "SomePods"}})),
            "spec.drain.scope",
        ),
        (
            "unknown onTimeout",
            with(json!({"drain": {"onTimeout": "Shrug"}})),
            "spec.drain.onTimeout",
        ),
        (
            "maxConcurrent zero",
            with(json!({"maxConcurrent": 0})),
            "spec.maxConcurrent",
        ),
        (
            "maxConcurrent over 100%",
            with(json!({"maxConcurrent": "150%"})),
            "spec.maxConcurrent",
        ),
        (
            "maxUnhealthy negative",
            with(json!({"maxUnhealthy": -1})),
            "spec.maxUnhealthy",
        ),
        (
            "maxUnhealthy not a percentage",
            with(json!({"maxUnhealthy": "half"})),
            "spec.maxUnhealthy",
        ),
        (
            "stableFor longer than verification timeout",
            with(json!({"verification": {"stableFor": "20m", "timeout": "10m"}})),
            "verification.stableFor",
        ),
        (
            "validation pod without containers",
            with(json!({"verification": {"validationPod": {"template": {"spec": {}}}}})),
            "verification.validationPod.template",
        ),
        (
            "validation pod in another namespace",
            with(
                json!({"verification": {"validationPod": {"template": {"metadata": {"namespace": "gpuhealth-system"}, "spec": {"containers": [{"name": "c"}]}}}}}),
            ),
            "verification.validationPod.template.metadata.namespace",
        ),
        (
            "validation pod on the host's network",
            with(
                json!({"verification": {"validationPod": {"template": {"spec": {"hostNetwork": true, "containers": [{"name": "c"}]}}}}}),
            ),
            "verification.validationPod.template.spec.hostNetwork",
        ),
        (
            "validation pod in the host's PIDs",
            with(
                json!({"verification": {"validationPod": {"template": {"spec": {"hostPID": true, "containers": [{"name": "c"}]}}}}}),
            ),
            "verification.validationPod.template.spec.hostPID",
        ),
        (
            "validation pod in the host's IPC",
            with(
                json!({"verification": {"validationPod": {"template": {"spec": {"hostIPC": true, "containers": [{"name": "c"}]}}}}}),
            ),
            "verification.validationPod.template.spec.hostIPC",
        ),
        (
            "validation pod as the agent",
            with(
                json!({"verification": {"validationPod": {"template": {"spec": {"serviceAccountName": "gpuhealth-agent", "containers": [{"name": "c"}]}}}}}),
            ),
            "verification.validationPod.template.spec.serviceAccountName",
        ),
        (
            "validation pod as another account (old field)",
            with(
                json!({"verification": {"validationPod": {"template": {"spec": {"serviceAccount": "default", "containers": [{"name": "c"}]}}}}}),
            ),
            "verification.validationPod.template.spec.serviceAccount",
        ),
        (
            "validation pod with a token",
            with(
                json!({"verification": {"validationPod": {"template": {"spec": {"automountServiceAccountToken": true, "containers": [{"name": "c"}]}}}}}),
            ),
            "verification.validationPod.template.spec.automountServiceAccountToken",
        ),
        (
            "validation pod with a projected token",
            with(
                json!({"verification": {"validationPod": {"template": {"spec": {"volumes": [{"name": "t", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}}], "containers": [{"name": "c"}]}}}}}),
            ),
            "verification.validationPod.template.spec.volumes[0].projected.sources[0].serviceAccountToken",
        ),
        (
            "validation pod under the NVIDIA runtime",
            with(
                json!({"verification": {"validationPod": {"template": {"spec": {"runtimeClassName": "nvidia", "containers": [{"name": "c"}]}}}}}),
            ),
            "verification.validationPod.template.spec.runtimeClassName",
        ),
        (
            "validation pod asking for every GPU",
            with(
                json!({"verification": {"validationPod": {"template": {"spec": {"containers": [{"name": "c", "env": [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]}]}}}}}),
            ),
            "verification.validationPod.template.spec.containers[0].env[0].name",
        ),
        (
            "validation pod mounting the host",
            with(
                json!({"verification": {"validationPod": {"template": {"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}], "containers": [{"name": "c"}]}}}}}),
            ),
            "verification.validationPod.template.spec.volumes[0].hostPath",
        ),
        (
            "privileged validation pod",
            with(
                json!({"verification": {"validationPod": {"template": {"spec": {"containers": [{"name": "c", "securityContext": {"privileged": true}}]}}}}}),
            ),
            "verification.validationPod.template.spec.containers[0].securityContext.privileged",
        ),
        (
            "privileged init container",
            with(
                json!({"verification": {"validationPod": {"template": {"spec": {"initContainers": [{"name": "i", "securityContext": {"privileged": true}}], "containers": [{"name": "c"}]}}}}}),
            ),
            "verification.validationPod.template.spec.initContainers[0].securityContext.privileged",
        ),
        (
            "validation pod escalating",
            with(
                json!({"verification": {"validationPod": {"template": {"spec": {"containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": true}}]}}}}}),
            ),
            "verification.validationPod.template.spec.containers[0].securityContext.allowPrivilegeEscalation",
        ),
        (
            "validation pod adding a capability",
            with(
                json!({"verification": {"validationPod": {"template": {"spec": {"containers": [{"name": "c", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]}}}}}),
            ),
            "verification.validationPod.template.spec.containers[0].securityContext.capabilities.add",
        ),
        (
            "validation pod on a host port",
            with(
                json!({"verification": {"validationPod": {"template": {"spec": {"containers": [{"name": "c", "ports": [{"containerPort": 80, "hostPort": 80}]}]}}}}}),
            ),
            "verification.validationPod.template.spec.containers[0].ports[0].hostPort",
        ),
        (
            "validation pod with an ephemeral container",
            with(
                json!({"verification": {"validationPod": {"template": {"spec": {"ephemeralContainers": [{"name": "e"}], "containers": [{"name": "c"}]}}}}}),
            ),
            "verification.validationPod.template.spec.ephemeralContainers",
        ),
        (
            "Healthy as an unhealthy state",
            with(json!({"detection": {"gpuReport": {"unhealthyStates": ["Healthy"]}}})),
            "detection.gpuReport.unhealthyStates",
        ),
        (
            "no unhealthy states",
            with(json!({"detection": {"gpuReport": {"unhealthyStates": []}}})),
            "detection.gpuReport.unhealthyStates",
        ),
        (
            "a condition rule naming no writer",
            with(
                json!({"detection": {"nodeConditions": [{"type": "SysLogsXIDError", "status": "True"}]}}),
            ),
            "detection.nodeConditions[].writers must name who may write the condition",
        ),
        (
            "a writer both user and group",
            with(
                json!({"detection": {"nodeConditions": [{"type": "SysLogsXIDError", "status": "True",
                "writers": [{"user": "system:serviceaccount:npd:npd", "group": "system:nodes"}]}]}}),
            ),
            "a writer is exactly one of user and group",
        ),
        (
            "malformed condition type",
            with(
                json!({"detection": {"nodeConditions": [{"type": "bad type!", "status": "True"}]}}),
            ),
            "detection.nodeConditions[0].type",
        ),
        (
            "a condition rule on the node lifecycle's Ready",
            with(
                json!({"detection": {"nodeConditions": [{"type": "Ready", "status": "False",
                "writers": [{"group": "system:nodes"}]}]}}),
            ),
            "spec.detection.nodeConditions[0].type: Invalid value: \"Ready\": detection.nodeConditions[].type must not be",
        ),
        (
            "a condition rule on the agent's GpuHealthy",
            with(json!({"detection": {"nodeConditions": [
                {"type": "SysLogsXIDError", "status": "True", "writers": [{"group": "system:nodes"}]},
                {"type": "GpuHealthy", "status": "False", "writers": [{"group": "system:nodes"}]}]}})),
            "spec.detection.nodeConditions[1].type: Invalid value: \"GpuHealthy\": detection.nodeConditions[].type must not be",
        ),
        (
            "repeated condition type",
            with(json!({"detection": {"nodeConditions": [
                {"type": "SysLogsXIDError", "status": "True"},
                {"type": "SysLogsXIDError", "status": "False"}]}})),
            "spec.detection.nodeConditions[1]",
        ),
        (
            "condition status not a status",
            with(
                json!({"detection": {"nodeConditions": [{"type": "GpuHealthy", "status": "Maybe"}]}}),
            ),
            "spec.detection.nodeConditions[0].status",
        ),
        (
            "xid zero",
            with(json!({"detection": {"xidOverrides": [{"xid": 0, "action": "GpuReset"}]}})),
            "spec.detection.xidOverrides[0].xid",
        ),
        (
            "repeated xid override",
            with(json!({"detection": {"xidOverrides": [
                {"xid": 13, "action": "Ignore"}, {"xid": 13, "action": "GpuReset"}]}})),
            "spec.detection.xidOverrides[1]",
        ),
        (
            "unknown selector operator",
            json!({"nodeSelector": {"matchExpressions": [{"key": "gpu", "operator": "Contains", "values": ["a"]}]}}),
            "nodeSelector.matchExpressions[].operator",
        ),
        (
            "In without values",
            json!({"nodeSelector": {"matchExpressions": [{"key": "gpu", "operator": "In"}]}}),
            "nodeSelector.matchExpressions[].values",
        ),
    ]
}

#[tokio::test]
async fn invalid_policies_are_refused_naming_the_field() {
    let client = setup().await;
    let api = policies(&client);
    let cases = invalid_policies();
    assert!(cases.len() >= 15);
    let mut failures = Vec::new();
    for (what, spec, field) in cases {
        let name = unique("invalid");
        match api
            .create(&PostParams::default(), &policy(&name, spec))
            .await
        {
            Ok(_) => failures.push(format!("{what}: accepted")),
            Err(kube::Error::Api(status)) => {
                if status.code != 422 {
                    failures.push(format!(
                        "{what}: refused with {} instead of 422: {}",
                        status.code, status.message
                    ));
                } else if !status.message.contains(field) {
                    failures.push(format!(
                        "{what}: message does not name {field}: {}",
                        status.message
                    ));
                }
            }
            Err(other) => failures.push(format!("{what}: unexpected error {other}")),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A record's ids are read back by their parsers when a watch lists the
/// records, and one that would not read back fails the whole list: the
/// API server refuses such a value, naming the field, whoever writes it.
#[tokio::test]
async fn a_record_whose_ids_would_not_read_back_is_refused_naming_the_field() {
    let client = setup().await;
    let api: Api<GpuNodeHealth> = Api::all(client.clone());
    let name = unique("unreadable");
    api.create(
        &PostParams::default(),
        &GpuNodeHealth::new(&name, Default::default()),
    )
    .await
    .expect("record created");
    let quarantine = |device: &str| {
        json!({"quarantine": {
            "incident": "inc-1780000000-0123456789ab", "scope": "Gpu", "why": QuarantineWhy::GpusFenced.as_str(),
            "message": "m", "since": "2026-12-08T00:00:00Z",
            "gpus": [{"uuid": "GPU-1", "fence": "DeviceTaintRule", "device": device}],
        }})
    };
    let holders = |pod: &str| {
        json!({"gpus": [{"uuid": "GPU-1", "index": 0, "pciBusId": "00000000:3B:00.0",
            "health": "Healthy", "pods": [pod]}]})
    };
    let cases = [
        (quarantine("gpu-0"), "status.quarantine.gpus[0].device"),
        (
            quarantine("gpu.nvidia.com/gpu-0"),
            "status.quarantine.gpus[0].device",
        ),
        (holders("llama-0"), "status.gpus[0].pods[0]"),
        (holders("ml/llama/0"), "status.gpus[0].pods[0]"),
    ];
    let mut failures = Vec::new();
    for (status, field) in cases {
        let patch = Patch::Merge(json!({"status": status}));
        match api
            .patch_status(&name, &PatchParams::default(), &patch)
            .await
        {
            Ok(_) => failures.push(format!("{status}: accepted")),
            Err(kube::Error::Api(e)) if e.code == 422 && e.message.contains(field) => {}
            Err(other) => failures.push(format!("{status}: {other}")),
        }
    }
    // What the parsers read is accepted: the refusals above are the ids'.
    for status in [
        quarantine("gpu.nvidia.com/rack-1/node-a/gpu-0"),
        holders("ml/llama-0"),
    ] {
        let patch = Patch::Merge(json!({"status": status}));
        if let Err(e) = api
            .patch_status(&name, &PatchParams::default(), &patch)
            .await
        {
            failures.push(format!("{status}: refused: {e}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let read = api.get(&name).await.expect("the record still reads back");
    let device = read
        .status
        .and_then(|s| s.quarantine)
        .and_then(|q| q.gpus.into_iter().next())
        .and_then(|g| g.device);
    assert_eq!(
        device.map(|d| d.pool),
        Some("rack-1/node-a".to_owned()),
        "a pool of several subdomains reads back whole"
    );
    api.delete(&name, &Default::default())
        .await
        .expect("deleted");
}

fn now() -> Time {
    Time(Timestamp::now())
}

#[tokio::test]
async fn kubectl_lists_both_kinds_with_their_columns_in_80_columns() {
    let client = setup().await;
    // Names as long as the incident's (`demo-fleet`, `192.168.1.1`).
    let policy_name = unique("p");
    let node_name = unique("n");
    let run = unique("columns");
    let labels = || Some([("e2e-columns".to_owned(), run.clone())].into());
    let apply = PatchParams::apply("gpuhealth-e2e").force();

    let policy_api: Api<GpuHealthPolicy> = Api::all(client.clone());
    let selector = LabelSelector {
        match_labels: Some([("gpu".into(), "true".into())].into()),
        ..Default::default()
    };
    let mut p = GpuHealthPolicy::new(&policy_name, GpuHealthPolicySpec::for_selector(selector));
    p.metadata.labels = labels();
    policy_api
        .create(&PostParams::default(), &p)
        .await
        .expect("policy created");
    p.status = Some(GpuHealthPolicyStatus {
        nodes: 10,
        healthy: 8,
        remediating: 1,
        failed: 1,
        ..Default::default()
    });
    policy_api
        .patch_status(
            &policy_name,
            &apply,
            &Patch::Apply(json!({
            "apiVersion": "gpuhealth.io/v1alpha1", "kind": "GpuHealthPolicy", "status": p.status})),
        )
        .await
        .expect("policy status written");

    let gnh_api: Api<GpuNodeHealth> = Api::all(client.clone());
    let mut gnh = GpuNodeHealth::new(&node_name, Default::default());
    gnh.metadata.labels = labels();
    gnh_api
        .create(&PostParams::default(), &gnh)
        .await
        .expect("node health created");
    let status = GpuNodeHealthStatus {
        phase: Phase::Quarantined,
        policy: Some(policy_name.clone()),
        reason: Some(Reason::Xid),
        bad_gpus: 1,
        action: Some(ActionStatus {
            id: "r-1".parse().expect("an id"),
            type_: RecoveryAction::GpuReset,
            attempt: 1,
            gpus: vec!["GPU-5f2b1c3e-8a4d-4e6f-9b0a-1c2d3e4f5a6b".into()],
            started_at: now(),
            requested_at: Some(now()),
            deadline: Some(now()),
        }),
        ..Default::default()
    };
    gnh_api
        .patch_status(
            &node_name,
            &apply,
            &Patch::Apply(json!({
            "apiVersion": "gpuhealth.io/v1alpha1", "kind": "GpuNodeHealth", "status": status})),
        )
        .await
        .expect("node health status written");

    // `kubectl get gpuhealth` prefixes each name with its kind and group:
    // the default columns are chosen to fit 80 columns even so.
    let selector = format!("e2e-columns={run}");
    let both = kubectl(&["get", "gpuhealth", "-l", &selector])
        .await
        .expect("kubectl get gpuhealth");
    assert!(
        both.contains(&format!("gpuhealthpolicy.gpuhealth.io/{policy_name}")),
        "{both}"
    );
    assert!(
        both.contains(&format!("gpunodehealth.gpuhealth.io/{node_name}")),
        "{both}"
    );
    for line in both.lines() {
        assert!(line.len() <= 80, "{} columns: {line}\n{both}", line.len());
    }

    let words = |out: &str, line: usize| -> Vec<String> {
        out.lines()
            .nth(line)
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    };
    let ghp = kubectl(&["get", "ghp", &policy_name])
        .await
        .expect("kubectl get ghp");
    assert_eq!(
        words(&ghp, 0),
        ["NAME", "MODE", "NODES", "REMEDIATING", "FAILED"],
        "{ghp}"
    );
    assert_eq!(
        words(&ghp, 1),
        [policy_name.as_str(), "Enforce", "10", "1", "1"],
        "{ghp}"
    );
    let ghp = kubectl(&["get", "ghp", &policy_name, "-o", "wide"])
        .await
        .expect("kubectl get ghp -o wide");
    assert_eq!(
        words(&ghp, 0),
        [
            "NAME",
            "MODE",
            "NODES",
            "HEALTHY",
            "REMEDIATING",
            "FAILED",
            "AGE"
        ],
        "{ghp}"
    );
    assert_eq!(
        words(&ghp, 1)[..6],
        [policy_name.as_str(), "Enforce", "10", "8", "1", "1"],
        "{ghp}"
    );

    let gnh = kubectl(&["get", "gnh", &node_name])
        .await
        .expect("kubectl get gnh");
    assert_eq!(
        words(&gnh, 0),
        ["NAME", "PHASE", "FENCED", "REASON", "AGE"],
        "{gnh}"
    );
    assert_eq!(
        words(&gnh, 1)[..3],
        [node_name.as_str(), "Quarantined", Reason::Xid.as_str()],
        "{gnh}"
    );
    let gnh = kubectl(&["get", "gnh", &node_name, "-o", "wide"])
        .await
        .expect("kubectl get gnh -o wide");
    assert_eq!(
        words(&gnh, 0),
        [
            "NAME", "PHASE", "POLICY", "BAD-GPUS", "ACTION", "ATTEMPT", "FENCED", "REASON", "AGE"
        ],
        "{gnh}"
    );
    assert_eq!(
        words(&gnh, 1)[..7],
        [
            node_name.as_str(),
            "Quarantined",
            policy_name.as_str(),
            "1",
            "GpuReset",
            "1",
            Reason::Xid.as_str()
        ],
        "{gnh}"
    );
}

#[tokio::test]
async fn crds_are_established_with_names_and_categories() {
    setup().await;
    let out = kubectl(&["api-resources", "--api-group=gpuhealth.io", "-o", "wide"])
        .await
        .expect("api-resources");
    for expected in [
        "gpuhealthpolicies",
        "ghp",
        "gpunodehealths",
        "gnh",
        "gpuhealth",
    ] {
        assert!(
            out.contains(expected),
            "api-resources lacks {expected}:\n{out}"
        );
    }
    // Cluster-scoped: the NAMESPACED column says false for both.
    for line in out.lines().filter(|l| l.contains("gpuhealth.io")) {
        assert!(
            line.split_whitespace().any(|w| w == "false"),
            "not cluster-scoped: {line}"
        );
    }
}

#[tokio::test]
async fn the_shipped_kustomizations_apply() {
    setup().await;
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    // A server-side dry run cannot put objects in a namespace it only
    // pretends to create: the namespaces first, for real.
    for dir in ["config/namespace", "config/validation"] {
        kubectl(&["apply", "--server-side", "-k", &format!("{root}/{dir}")])
            .await
            .unwrap_or_else(|e| panic!("kubectl apply -k {dir}: {e}"));
    }
    for dir in [
        "config/default",
        "config/rbac-force-delete",
        "config/samples",
    ] {
        let path = format!("{root}/{dir}");
        let out = kubectl(&[
            "apply",
            "--dry-run=server",
            "--server-side",
            "--force-conflicts",
            "-k",
            &path,
        ])
        .await
        .unwrap_or_else(|e| panic!("kubectl apply -k {dir}: {e}"));
        assert!(
            out.contains("serverside-applied") || out.contains("configured"),
            "{dir}: {out}"
        );
    }
}
