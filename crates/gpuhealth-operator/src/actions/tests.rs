//! Each action against the fake API server: what it writes, and what each
//! refusal the API server can answer makes of it.

use std::time::Duration;

use gpuhealth_api::{
    contract::{CORDONED_BY_ANNOTATION, GPU_HEALTHY_CONDITION, RequestId},
    gang::EVICT_AT_ANNOTATION,
    policy::GpuHealthPolicySpec,
    vocabulary::{DeviceId, FindingKind, PodKey},
};
use gpuhealth_engine::machine::{Action, ActionKind};
use k8s_openapi::{api::core::v1::Node, jiff::Timestamp};
use serde_json::json;

use super::{Outcome, run};
use crate::{context::Error, error::Retry, testing::World};

const NODE: &str = "gpu-node-1";
const INCIDENT: &str = "inc-1764950400-00000000abcd";

fn node() -> Node {
    serde_json::from_value(json!({
        "metadata": {"name": NODE, "resourceVersion": "41"},
    }))
    .expect("node")
}

fn pod() -> PodKey {
    PodKey::new("ml-serving", "llama-0")
}

fn spec() -> GpuHealthPolicySpec {
    let mut spec = GpuHealthPolicySpec::for_selector(Default::default());
    spec.drain.grace_period = Some("30s".parse().expect("duration"));
    spec
}

fn spec_with_validation_pod() -> GpuHealthPolicySpec {
    serde_json::from_value(json!({
        "nodeSelector": {},
        "verification": {"validationPod": {"template": {
            "spec": {"containers": [{"name": "check", "image": "gpu-check:1"}]},
        }}},
    }))
    .expect("spec")
}

async fn carry(
    world: &World,
    spec: &GpuHealthPolicySpec,
    action: Action,
) -> Result<Outcome, Error> {
    run(&world.ctx, &node(), spec, &action).await
}

/// Carries `action` out against an API server that fails it, and checks
/// the error names the action.
async fn fails_as(world: &World, spec: &GpuHealthPolicySpec, action: Action, kind: ActionKind) {
    let error = carry(world, spec, action).await.expect_err("failed");
    assert!(
        matches!(&error, Error::Act { action, .. } if *action == kind),
        "{error:?}"
    );
}

fn world() -> World {
    World::new(Duration::from_secs(600))
}

fn evict() -> Action {
    Action::Evict { pod: pod() }
}

#[tokio::test]
async fn a_cordon_is_one_write_with_the_record_of_whose_it_is() {
    let w = world();
    let outcome = carry(
        &w,
        &spec(),
        Action::Cordon {
            incident: INCIDENT.into(),
        },
    )
    .await;
    assert_eq!(outcome.expect("cordoned"), Outcome::Done);
    let seen = w.api.seen();
    assert_eq!(w.api.lines(), [format!("PATCH /api/v1/nodes/{NODE}")]);
    assert_eq!(seen[0].body["spec"]["unschedulable"], json!(true));
    let record = seen[0].body["metadata"]["annotations"][CORDONED_BY_ANNOTATION]
        .as_str()
        .expect("the record");
    assert!(record.contains(INCIDENT), "{record}");
    assert!(
        seen[0].uri.contains("fieldManager=gpuhealth-operator"),
        "{}",
        seen[0].uri
    );
}

#[tokio::test]
async fn a_failed_cordon_names_its_node_and_action_and_backs_off() {
    let w = world();
    w.api.on("PATCH", "/nodes/", 500);
    let error = carry(
        &w,
        &spec(),
        Action::Cordon {
            incident: INCIDENT.into(),
        },
    )
    .await
    .expect_err("the API server failed");
    assert!(
        matches!(&error, Error::Act { node, action: ActionKind::Cordon, .. } if node == NODE),
        "{error:?}"
    );
    assert_eq!(error.retry(), Retry::BackOff);
}

#[tokio::test]
async fn an_uncordon_is_guarded_by_the_version_decided_on() {
    let w = world();
    w.api.on("PATCH", "/nodes/", 409);
    let error = carry(
        &w,
        &spec(),
        Action::Uncordon {
            incident: INCIDENT.into(),
        },
    )
    .await
    .expect_err("someone wrote the node since");
    assert_eq!(error.code(), Some(409));
    assert_eq!(error.retry(), Retry::Soon, "decided again at once");
    let body = &w.api.seen()[0].body;
    assert_eq!(body["metadata"]["resourceVersion"], json!("41"));
    assert_eq!(
        body["metadata"]["annotations"][CORDONED_BY_ANNOTATION],
        json!(null)
    );
}

#[tokio::test]
async fn a_node_with_no_report_gets_gpu_healthy_unknown_only_as_decided_on() {
    let w = world();
    let mark = || Action::MarkGpuHealthUnknown {
        message: "no GPU report".into(),
    };
    let outcome = carry(&w, &spec(), mark()).await.expect("written");
    assert_eq!(outcome, Outcome::Done);
    assert_eq!(
        w.api.lines(),
        [format!("PATCH /api/v1/nodes/{NODE}/status")]
    );
    let seen = &w.api.seen()[0];
    assert_eq!(seen.body["metadata"]["resourceVersion"], json!("41"));
    let conditions = seen.body["status"]["conditions"]
        .as_array()
        .expect("conditions");
    assert_eq!(conditions.len(), 1, "{conditions:?}");
    assert_eq!(conditions[0]["type"], json!(GPU_HEALTHY_CONDITION));
    assert_eq!(conditions[0]["status"], json!("Unknown"));
    assert_eq!(
        conditions[0]["reason"],
        json!(FindingKind::NoReport.as_str())
    );
    assert_eq!(conditions[0]["message"], json!("no GPU report"));
    assert!(
        seen.uri.contains("fieldManager=gpuhealth-operator"),
        "{}",
        seen.uri
    );
    // A report written since: decided again at once.
    w.api.on("PATCH", "/status", 409);
    let error = carry(&w, &spec(), mark()).await.expect_err("a conflict");
    assert_eq!(error.retry(), Retry::Soon);
    // The node gone: nothing left to say.
    w.api.on("PATCH", "/status", 404);
    assert_eq!(
        carry(&w, &spec(), mark()).await.expect("gone"),
        Outcome::Gone
    );
}

#[tokio::test]
async fn an_eviction_a_budget_refuses_is_tried_again_never_forced() {
    let w = world();
    w.api.on("POST", "/eviction", 429);
    assert_eq!(
        carry(&w, &spec(), evict()).await.expect("refused"),
        Outcome::Refused
    );
    assert_eq!(
        w.api.lines(),
        ["POST /api/v1/namespaces/ml-serving/pods/llama-0/eviction"],
        "no delete after the refusal"
    );
    let body = &w.api.seen()[0].body;
    assert_eq!(
        body["deleteOptions"]["gracePeriodSeconds"],
        json!(30),
        "{body}"
    );
}

#[tokio::test]
async fn an_eviction_of_a_pod_already_gone_is_done_and_any_other_failure_fails() {
    let w = world();
    assert_eq!(
        carry(&w, &spec(), evict()).await.expect("evicted"),
        Outcome::Done
    );
    w.api.on("POST", "/eviction", 404);
    assert_eq!(
        carry(&w, &spec(), evict()).await.expect("gone"),
        Outcome::Gone
    );
    w.api.on("POST", "/eviction", 500);
    fails_as(&w, &spec(), evict(), ActionKind::Evict).await;
}

#[tokio::test]
async fn each_pod_write_of_a_pod_gone_is_done() {
    let at: Timestamp = "2026-12-05T12:00:00Z".parse().expect("time");
    let actions = [
        Action::ForceDelete { pod: pod() },
        Action::TellGangMember {
            pod: pod(),
            at,
            why: "rank 3's GPU failed".into(),
        },
        Action::EvictGangMember {
            pod: pod(),
            why: "rank 3's GPU failed".into(),
        },
        Action::SetGpuHealthy {
            pod: pod(),
            healthy: false,
            message: "Xid 79".into(),
        },
    ];
    for action in actions {
        let w = world();
        w.api.on("PATCH", "/pods/", 404);
        w.api.on("DELETE", "/pods/", 404);
        let outcome = carry(&w, &spec(), action.clone()).await;
        assert_eq!(outcome.expect("no error"), Outcome::Gone, "{action:?}");
        assert_eq!(
            w.api.lines().len(),
            1,
            "{action:?}: nothing after the 404: {:?}",
            w.api.lines()
        );
    }
}

#[tokio::test]
async fn a_gang_member_is_marked_before_it_is_deleted() {
    let w = world();
    let action = Action::EvictGangMember {
        pod: pod(),
        why: "rank 3's GPU failed".into(),
    };
    assert_eq!(
        carry(&w, &spec(), action).await.expect("deleted"),
        Outcome::Done
    );
    assert_eq!(
        w.api.lines(),
        [
            "PATCH /api/v1/namespaces/ml-serving/pods/llama-0/status",
            "DELETE /api/v1/namespaces/ml-serving/pods/llama-0",
        ]
    );
    let told = Action::TellGangMember {
        pod: pod(),
        at: "2026-12-05T12:00:00Z".parse().expect("time"),
        why: "rank 3's GPU failed".into(),
    };
    let w = world();
    carry(&w, &spec(), told).await.expect("told");
    let seen = w.api.seen();
    assert_eq!(
        seen[0].body["metadata"]["annotations"][EVICT_AT_ANNOTATION],
        json!("2026-12-05T12:00:00Z")
    );
    assert_eq!(
        seen[1].line(),
        "PATCH /api/v1/namespaces/ml-serving/pods/llama-0/status"
    );
}

#[tokio::test]
async fn a_request_the_agent_would_refuse_is_never_written() {
    let w = world();
    let reset = Action::RequestReset {
        id: RequestId::for_incident(NODE, 1_764_950_400),
        gpus: vec!["not-a-gpu".into()],
        requested_at: Timestamp::now(),
    };
    let error = carry(&w, &spec(), reset).await.expect_err("refused");
    assert!(
        matches!(
            &error,
            Error::InvalidRequest {
                action: ActionKind::RequestReset,
                ..
            }
        ),
        "{error:?}"
    );
    assert_eq!(error.retry(), Retry::OnChange);
    assert!(w.api.seen().is_empty(), "{:?}", w.api.lines());
}

#[tokio::test]
async fn a_validation_pod_that_exists_is_left_and_one_refused_is_said() {
    let spec = spec_with_validation_pod();
    let create = || Action::CreateValidationPod {
        name: "gpuhealth-validate-gpu-node-1-1".into(),
    };
    let w = world();
    assert_eq!(
        carry(&w, &spec, create()).await.expect("created"),
        Outcome::Done
    );
    assert_eq!(
        w.api.lines(),
        ["POST /api/v1/namespaces/gpuhealth-validation/pods"]
    );
    w.api.on("POST", "/pods", 409);
    assert_eq!(
        carry(&w, &spec, create()).await.expect("exists"),
        Outcome::Gone
    );

    let w = world();
    w.api.on("POST", "/pods", 403);
    assert_eq!(
        carry(&w, &spec, create()).await.expect("refused"),
        Outcome::Refused
    );
    let event = w
        .api
        .seen()
        .into_iter()
        .find(|s| s.uri.contains("/events"))
        .expect("a Warning Event says so");
    assert_eq!(event.body["reason"], json!("ValidationPodRefused"));

    let w = world();
    w.api.on("POST", "/pods", 500);
    fails_as(&w, &spec, create(), ActionKind::CreateValidationPod).await;
}

#[tokio::test]
async fn a_validation_pod_already_deleted_is_done() {
    let w = world();
    w.api.on("DELETE", "/pods/", 404);
    let delete = Action::DeleteValidationPod {
        name: "gpuhealth-validate-gpu-node-1-1".into(),
    };
    let outcome = carry(&w, &spec_with_validation_pod(), delete).await;
    assert_eq!(outcome.expect("gone"), Outcome::Gone);
}

#[tokio::test]
async fn a_fence_where_the_cluster_serves_no_device_taints_is_refused_unwritten() {
    let w = world();
    let taint = Action::TaintDevice {
        rule: "gpuhealth-gpu-node-1-gpu-0".into(),
        device: DeviceId::new("gpu.nvidia.com", "gpu-node-1", "gpu-0"),
        incident: INCIDENT.into(),
    };
    let error = carry(&w, &spec(), taint).await.expect_err("refused");
    assert!(
        matches!(
            error,
            Error::InvalidRequest {
                action: ActionKind::TaintDevice,
                ..
            }
        ),
        "{error:?}"
    );
    assert!(w.api.seen().is_empty());
}

#[tokio::test]
async fn each_outcome_is_counted() {
    let w = world();
    w.api.on("POST", "/eviction", 429);
    carry(&w, &spec(), evict()).await.expect("refused");
    w.api.on("POST", "/eviction", 500);
    carry(&w, &spec(), evict()).await.expect_err("failed");
    let count = |outcome: &str| {
        w.ctx
            .metrics
            .actions
            .get_or_create(&crate::metrics::ActionLabels {
                action: "evict".into(),
                outcome: outcome.into(),
            })
            .get()
    };
    assert_eq!((count("refused"), count("error"), count("done")), (1, 1, 0));
}

fn taint() -> Action {
    Action::TaintDevice {
        rule: "gpuhealth-inc-1764950400-00000000abcd-gpu-7".into(),
        device: DeviceId::new("gpu.nvidia.com", "gpu-node-1", "gpu-7"),
        incident: INCIDENT.into(),
    }
}

#[tokio::test]
async fn a_gpus_fence_names_its_incident_and_one_already_up_is_left() {
    let w = World::with_dra(Duration::from_secs(600));
    assert_eq!(
        carry(&w, &spec(), taint()).await.expect("fenced"),
        Outcome::Done
    );
    let seen = w.api.seen();
    assert_eq!(
        w.api.lines(),
        ["POST /apis/resource.k8s.io/v1/devicetaintrules"]
    );
    let labels = seen[0].body["metadata"]["labels"].to_string();
    assert!(labels.contains(INCIDENT), "{labels}");
    w.api.on("POST", "/devicetaintrules", 409);
    assert_eq!(
        carry(&w, &spec(), taint()).await.expect("up"),
        Outcome::Gone
    );
    w.api.on("POST", "/devicetaintrules", 500);
    fails_as(&w, &spec(), taint(), ActionKind::TaintDevice).await;
}

#[tokio::test]
async fn a_gpus_fence_already_lifted_is_done() {
    let w = World::with_dra(Duration::from_secs(600));
    w.api.on("DELETE", "/devicetaintrules/", 404);
    let untaint = Action::UntaintDevice {
        rule: "gpuhealth-inc-1764950400-00000000abcd-gpu-7".into(),
    };
    assert_eq!(
        carry(&w, &spec(), untaint).await.expect("gone"),
        Outcome::Gone
    );
    assert_eq!(
        w.api.lines(),
        [
            "DELETE /apis/resource.k8s.io/v1/devicetaintrules/gpuhealth-inc-1764950400-00000000abcd-gpu-7"
        ]
    );
}
