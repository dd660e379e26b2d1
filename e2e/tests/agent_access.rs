//! What each part of the agent may do, with real tokens bound to the
//! reporter's and the executor's pods on one node:
//! `config/agent/container-toolkit` (the default) applied to the real API
//! server, its RBAC and its ValidatingAdmissionPolicies in force. The
//! reporter writes only its node's report and `GpuHealthy` condition; the
//! executor only its node's request result, the operands' labels it pauses,
//! and Events about its own Node.

use std::time::Duration;

use gpuhealth_e2e::{
    client,
    cluster::client_with_token,
    identities, kubectl,
    scenario::WAIT,
    sim::{GpuNodeSpec, gpu_node, gpu_operator_runtime_class, node_is_ready},
    unique,
    wait::{until, until_set},
};
use k8s_openapi::api::{
    apps::v1::{DaemonSet, Deployment},
    core::v1::{Node, Pod, Secret},
    events::v1 as events,
};
use kube::{
    Api, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams},
    runtime::watcher,
};
use serde_json::json;

const NAMESPACE: &str = "gpuhealth-system";

fn merge(value: serde_json::Value) -> Patch<serde_json::Value> {
    Patch::Merge(value)
}

/// `Err` with the API server's message when refused.
async fn patch(api: &Api<Node>, node: &str, body: serde_json::Value) -> Result<(), String> {
    api.patch(node, &PatchParams::default(), &merge(body))
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

async fn patch_status(api: &Api<Node>, node: &str, body: serde_json::Value) -> Result<(), String> {
    api.patch_status(node, &PatchParams::default(), &Patch::Strategic(body))
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

fn gpu_healthy(status: &str) -> serde_json::Value {
    json!({"status": {"conditions": [{
        "type": "GpuHealthy", "status": status, "reason": "Test", "message": "from the agent's token",
        "lastHeartbeatTime": "2026-11-29T00:00:00Z", "lastTransitionTime": "2026-11-29T00:00:00Z",
    }]}})
}

#[tokio::test]
async fn the_agent_may_change_only_its_own_nodes_report() {
    let admin = client().await.expect("client");
    let nodes: Api<Node> = Api::all(admin.clone());
    let group = unique("access");
    let (own, other) = (format!("{group}-own"), format!("{group}-other"));
    for n in [&own, &other] {
        nodes
            .create(
                &PostParams::default(),
                &gpu_node(n, &group, &GpuNodeSpec::default()),
            )
            .await
            .expect("node");
        until(nodes.clone(), n, WAIT, node_is_ready)
            .await
            .expect("Ready");
    }
    gpu_operator_runtime_class(&admin)
        .await
        .expect("the nvidia RuntimeClass");
    for dir in ["namespace", "agent/container-toolkit"] {
        let config = format!("{}/../config/{dir}", env!("CARGO_MANIFEST_DIR"));
        kubectl(&["apply", "--server-side", "-k", &config])
            .await
            .unwrap_or_else(|e| panic!("kubectl apply -k config/{dir}: {e}"));
    }

    // Each DaemonSet's pod on our node: their tokens are the parts'.
    let pods: Api<Pod> = Api::namespaced(admin.clone(), NAMESPACE);
    let on_own = until_set(
        pods.clone(),
        watcher::Config::default().fields(&format!("spec.nodeName={own}")),
        "both parts' pods on its node",
        WAIT,
        |set| set.len() == 2,
    )
    .await
    .expect("the parts' pods");
    let pod_of = |account: &str| {
        on_own
            .values()
            .find(|p| {
                p.spec
                    .as_ref()
                    .and_then(|s| s.service_account_name.as_deref())
                    == Some(account)
            })
            .cloned()
            .unwrap_or_else(|| panic!("the pod of {account}"))
    };
    let pod = pod_of("gpuhealth-agent");
    // Bound to the pod, as the kubelet projects it: with the node's name.
    let token = identities::token(&admin, NAMESPACE, "gpuhealth-agent", Some(&pod))
        .await
        .expect("the reporter's token");
    let agent = client_with_token(&token).await.expect("reporter client");
    let as_agent: Api<Node> = Api::all(agent.clone());
    let executor_pod = pod_of("gpuhealth-executor");
    let token = identities::token(&admin, NAMESPACE, "gpuhealth-executor", Some(&executor_pod))
        .await
        .expect("the executor's token");
    let executor = client_with_token(&token).await.expect("executor client");
    let as_executor: Api<Node> = Api::all(executor.clone());

    // The policy is in force once the API server refuses the other node.
    let report = |v: &str| json!({"metadata": {"annotations": {"gpuhealth.io/gpus": v}}});
    let deadline = std::time::Instant::now() + WAIT;
    let refused = loop {
        match patch(&as_agent, &other, report("{}")).await {
            Err(e) => break e,
            Ok(()) => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the admission policy never took effect"
                );
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        }
    };
    assert!(refused.contains("only the Node it runs on"), "{refused}");

    // Allowed: the reporter's own Node's report and GpuHealthy condition;
    // the executor's request result there. Neither writes the other's.
    patch(&as_agent, &own, report("{\"version\":1}"))
        .await
        .expect("its report");
    let result = json!({"metadata": {"annotations": {"gpuhealth.io/request-result": "{}"}}});
    patch(&as_executor, &own, result)
        .await
        .expect("its request result");
    patch_status(&as_agent, &own, gpu_healthy("False"))
        .await
        .expect("its condition");
    as_agent.get(&other).await.expect("it may read other nodes");
    let forged = json!({"metadata": {"annotations": {"gpuhealth.io/request-result": "{\"by\":\"reporter\"}"}}});
    let e = patch(&as_agent, &own, forged)
        .await
        .expect_err("the reporter writes a request result");
    assert!(
        e.contains("may write gpuhealth.io/request-result")
            || e.contains("may change only its own annotations"),
        "{e}"
    );
    let e = patch(&as_executor, &own, report("{\"version\":2}"))
        .await
        .expect_err("the executor writes a report");
    assert!(
        e.contains("only a node's gpuhealth agent may write gpuhealth.io/gpus")
            || e.contains("may change only its own annotations"),
        "{e}"
    );
    let e = patch_status(&as_executor, &own, gpu_healthy("True"))
        .await
        .expect_err("the executor writes the GpuHealthy condition");
    // RBAC gives it no Node status at all.
    assert!(e.contains("cannot patch resource \"nodes/status\""), "{e}");
    let e = patch(
        &as_executor,
        &other,
        json!({"metadata": {"annotations": {"gpuhealth.io/request-result": "{}"}}}),
    )
    .await
    .expect_err("the executor writes another node's result");
    assert!(e.contains("only the Node it runs on"), "{e}");

    // Allowed to the executor: pausing the GPU Operator's operands for a
    // reset, and restoring them; nothing else of their labels. Nothing of
    // them to the reporter.
    let deploy =
        |v: &str| json!({"metadata": {"labels": {"nvidia.com/gpu.deploy.device-plugin": v}}});
    patch(&nodes, &own, deploy("true"))
        .await
        .expect("the GPU Operator's label");
    let e = patch(&as_agent, &own, deploy("paused-for-gpuhealth-reset"))
        .await
        .expect_err("the reporter pauses the device plugin");
    assert!(e.contains("only its executor"), "{e}");
    patch(&as_executor, &own, deploy("paused-for-gpuhealth-reset"))
        .await
        .expect("pausing the device plugin");
    patch(&as_executor, &own, deploy("true"))
        .await
        .expect("restoring the device plugin");
    // The driver's own deploy label is no operand the agent pauses: off,
    // it would unload the driver under every GPU of the node.
    let driver = |v: &str| json!({"metadata": {"labels": {"nvidia.com/gpu.deploy.driver": v}}});
    patch(&nodes, &own, driver("true"))
        .await
        .expect("the GPU Operator's driver label");
    for (what, body) in [
        ("pausing the driver", driver("paused-for-gpuhealth-reset")),
        ("switching an operand off", deploy("false")),
        (
            "adding an operand",
            json!({"metadata": {"labels": {"nvidia.com/gpu.deploy.sandbox-validator": "paused-for-gpuhealth-reset"}}}),
        ),
    ] {
        let e = patch(&as_executor, &own, body).await.expect_err(what);
        assert!(e.contains("pause and restore"), "{what}: {e}");
    }

    // Refused on its own Node: everything else.
    let refusals = [
        ("cordon", json!({"spec": {"unschedulable": true}}), "spec"),
        (
            "label",
            json!({"metadata": {"labels": {"gpuhealth.io/replace": "x"}}}),
            "labels",
        ),
        (
            "the operator's annotation",
            json!({"metadata": {"annotations": {"gpuhealth.io/reset-request": "{}"}}}),
            // Where config/admission is in force too, either policy may
            // answer first.
            "annotations|only the gpuhealth operator may write",
        ),
    ];
    for (what, body, says) in refusals {
        let e = patch(&as_agent, &own, body).await.expect_err(what);
        assert!(says.split('|').any(|s| e.contains(s)), "{what}: {e}");
    }
    let ready = json!({"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "Test", "message": "x"}]}});
    let e = patch_status(&as_agent, &own, ready)
        .await
        .expect_err("Ready condition");
    assert!(e.contains("only the GpuHealthy condition"), "{e}");
    let e = patch_status(&as_agent, &other, gpu_healthy("False"))
        .await
        .expect_err("another node's condition");
    assert!(e.contains("only the Node it runs on"), "{e}");

    // Nor what would let it delete, keep or hijack its Node: an owner that
    // does not exist (the garbage collector would delete the Node), a
    // finalizer, the addresses and the kubelet endpoint the API server uses.
    let owner = json!({"metadata": {"ownerReferences": [{
        "apiVersion": "v1", "kind": "ConfigMap", "name": "gone",
        "uid": "00000000-0000-0000-0000-000000000000",
    }]}});
    let e = patch(&as_agent, &own, owner).await.expect_err("an owner");
    assert!(e.contains("owners, finalizers or deletion"), "{e}");
    let finalizer = json!({"metadata": {"finalizers": ["example.com/keep"]}});
    let e = patch(&as_agent, &own, finalizer)
        .await
        .expect_err("a finalizer");
    assert!(e.contains("owners, finalizers or deletion"), "{e}");
    let addresses =
        json!({"status": {"addresses": [{"type": "InternalIP", "address": "203.0.113.7"}]}});
    let e = patch_status(&as_agent, &own, addresses)
        .await
        .expect_err("the addresses");
    assert!(e.contains("addresses, endpoints"), "{e}");
    let endpoint = json!({"status": {"daemonEndpoints": {"kubeletEndpoint": {"Port": 10999}}}});
    let e = patch_status(&as_agent, &own, endpoint)
        .await
        .expect_err("the kubelet endpoint");
    assert!(e.contains("addresses, endpoints"), "{e}");
    let capacity = json!({"status": {"capacity": {"nvidia.com/gpu": "16"}}});
    let e = patch_status(&as_agent, &own, capacity)
        .await
        .expect_err("the capacity");
    assert!(e.contains("addresses, endpoints"), "{e}");
    // The features the kubelet declares, which the scheduler matches pods
    // against (a field the policy's first list of status fields missed).
    let declared = json!({"status": {"declaredFeatures": ["NodeSwap"]}});
    let e = patch_status(&as_agent, &own, declared)
        .await
        .expect_err("the declared features");
    assert!(e.contains("addresses, endpoints"), "{e}");

    // And by RBAC, what it was never given.
    let forbidden = |r: kube::Result<()>| matches!(r, Err(kube::Error::Api(s)) if s.code == 403);
    let secrets: Api<Secret> = Api::all(agent.clone());
    assert!(
        forbidden(secrets.list(&ListParams::default()).await.map(|_| ())),
        "read Secrets"
    );
    assert!(
        forbidden(
            as_agent
                .delete(&other, &DeleteParams::default())
                .await
                .map(|_| ())
        ),
        "delete a Node"
    );
    let deployments: Api<Deployment> = Api::all(agent.clone());
    assert!(
        forbidden(deployments.list(&ListParams::default()).await.map(|_| ())),
        "list Deployments"
    );
    let event = |kind: &str, name: &str| -> events::Event {
        serde_json::from_value(json!({
            "metadata": {"name": unique("agent-event"), "namespace": "default"},
            "eventTime": "2026-12-04T00:00:00.000000Z",
            "type": "Warning", "reason": "RequestRefused", "action": "CarryOutRequest",
            "reportingController": "gpuhealth.io/agent", "reportingInstance": own,
            "regarding": {"kind": kind, "apiVersion": "v1", "name": name},
            "note": "from the agent's token",
        }))
        .expect("an Event")
    };
    // The reporter says nothing in Events, and may not read the records
    // the executor checks requests against.
    let reporter_events = Api::<events::Event>::namespaced(agent.clone(), "default");
    let e = reporter_events
        .create(&PostParams::default(), &event("Node", &own))
        .await
        .map(|_| ());
    assert!(forbidden(e), "the reporter creates an Event");
    let records: Api<gpuhealth_api::GpuNodeHealth> = Api::all(agent.clone());
    assert!(
        forbidden(records.get(&own).await.map(|_| ())),
        "the reporter reads a GpuNodeHealth"
    );
    // The executor's Events: about its own Node, and about nothing else.
    let events_api = Api::<events::Event>::namespaced(executor.clone(), "default");
    events_api
        .create(&PostParams::default(), &event("Node", &own))
        .await
        .expect("an Event about its own Node");
    for (kind, name) in [("Node", other.as_str()), ("Pod", "vllm-0")] {
        let e = events_api
            .create(&PostParams::default(), &event(kind, name))
            .await
            .expect_err("an Event about something else");
        assert!(
            e.to_string()
                .contains("may publish Events only about the Node it runs on"),
            "{kind} {name}: {e}"
        );
    }
    for (who, client) in [("the reporter", agent), ("the executor", executor)] {
        let evict: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
        assert!(
            forbidden(
                evict
                    .evict(&pod.name_any(), &Default::default())
                    .await
                    .map(|_| ())
            ),
            "{who} evicts a pod"
        );
        let secrets: Api<Secret> = Api::all(client);
        assert!(
            forbidden(secrets.list(&ListParams::default()).await.map(|_| ())),
            "{who} reads Secrets"
        );
    }

    // The DaemonSets would put a (simulated) agent pod on every GPU node
    // the other tests make: remove them; the policy and RBAC stay.
    for daemonset in ["gpuhealth-agent", "gpuhealth-executor"] {
        Api::<DaemonSet>::namespaced(admin.clone(), NAMESPACE)
            .delete(daemonset, &DeleteParams::default())
            .await
            .expect("remove the DaemonSet");
    }
    for n in [&own, &other] {
        let _ = nodes.delete(n, &DeleteParams::default()).await;
    }
}
