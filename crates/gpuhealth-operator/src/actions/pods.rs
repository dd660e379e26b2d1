//! Actions that write pods: the drain's evictions and deletions, a gang
//! member's notice, and the `gpuhealth.io/gpu-healthy` readiness gate.

use gpuhealth_api::{
    contract::GPU_HEALTHY_READINESS_GATE,
    gang::{DISRUPTION_PENDING_CONDITION, DISRUPTION_TARGET_REASON, EVICT_AT_ANNOTATION},
    policy::GpuHealthPolicySpec,
    vocabulary::PodKey,
};
use k8s_openapi::{
    api::{
        core::v1::{Node, Pod},
        policy::v1::Eviction,
    },
    apimachinery::pkg::apis::meta::v1::{DeleteOptions, ObjectMeta, Time},
    jiff::Timestamp,
};
use kube::{
    Api, ResourceExt,
    api::{DeleteParams, Patch},
    core::Status,
};
use serde_json::json;
use tracing::{info, warn};

use super::{Carried, Outcome, gone_if_missing, patch_params, post_params};
use crate::context::Context;

/// Through the Eviction API: a PodDisruptionBudget's 429 is
/// [`Outcome::Refused`], tried again next time, never forced.
pub(super) async fn evict(
    ctx: &Context,
    node: &Node,
    spec: &GpuHealthPolicySpec,
    pod: &PodKey,
) -> Carried {
    // Written here, not with kube's `Api::evict`: that sends its delete
    // options as `delete_options`, which the API server ignores, and the
    // policy's grace period with them.
    let eviction = Eviction {
        metadata: ObjectMeta {
            name: Some(pod.name.clone()),
            namespace: Some(pod.namespace.clone()),
            ..ObjectMeta::default()
        },
        delete_options: Some(DeleteOptions {
            grace_period_seconds: grace_seconds(spec).map(i64::from),
            ..DeleteOptions::default()
        }),
    };
    let name = node.name_any();
    let evicted = api(ctx, pod)
        .create_subresource::<_, Status>("eviction", &pod.name, &post_params(), &eviction)
        .await;
    match evicted {
        Err(kube::Error::Api(s)) if s.code == 429 => {
            info!(node = %name, %pod, "eviction refused by a disruption budget; will retry");
            Ok(Outcome::Refused)
        }
        result => {
            let outcome = gone_if_missing(result)?;
            if outcome == Outcome::Done {
                info!(node = %name, %pod, "evicted");
            }
            Ok(outcome)
        }
    }
}

/// With no grace, bypassing budgets: only where the policy says so.
pub(super) async fn force_delete(ctx: &Context, node: &Node, pod: &PodKey) -> Carried {
    let now = DeleteParams {
        grace_period_seconds: Some(0),
        ..Default::default()
    };
    let outcome = gone_if_missing(api(ctx, pod).delete(&pod.name, &now).await)?;
    if outcome == Outcome::Done {
        warn!(node = %node.name_any(), %pod, "force-deleted after the drain timeout, as the policy allows");
    }
    Ok(outcome)
}

/// The annotation for the pod's own processes (the downward API mounts
/// it), the condition for whoever watches the pod.
pub(super) async fn tell_gang_member(
    ctx: &Context,
    node: &Node,
    pod: &PodKey,
    at: Timestamp,
    why: &str,
    now: Time,
) -> Carried {
    let pods = api(ctx, pod);
    let patch = json!({"metadata": {"annotations": {EVICT_AT_ANNOTATION: Time(at)}}});
    let annotated = pods
        .patch(&pod.name, &patch_params(), &Patch::Merge(patch))
        .await;
    if gone_if_missing(annotated)? == Outcome::Gone {
        return Ok(Outcome::Gone);
    }
    let condition = json!({"status": {"conditions": [{
        "type": DISRUPTION_PENDING_CONDITION,
        "status": "True",
        "reason": "GangEvictionScheduled",
        "message": why,
        "lastTransitionTime": now,
    }]}});
    let told = pods
        .patch_status(&pod.name, &patch_params(), &Patch::Strategic(condition))
        .await;
    let outcome = gone_if_missing(told)?;
    if outcome == Outcome::Done {
        info!(node = %node.name_any(), %pod, %at, "told it leaves with its gang");
    }
    Ok(outcome)
}

/// The `DisruptionTarget` condition first, as the API server marks a pod it
/// evicts (a Job's podFailurePolicy can ignore the restart this causes),
/// then the delete with the policy's grace period.
pub(super) async fn evict_gang_member(
    ctx: &Context,
    node: &Node,
    spec: &GpuHealthPolicySpec,
    pod: &PodKey,
    why: &str,
    now: Time,
) -> Carried {
    let pods = api(ctx, pod);
    let condition = json!({"status": {"conditions": [{
        "type": "DisruptionTarget",
        "status": "True",
        "reason": DISRUPTION_TARGET_REASON,
        "message": why,
        "lastTransitionTime": now,
    }]}});
    let marked = pods
        .patch_status(&pod.name, &patch_params(), &Patch::Strategic(condition))
        .await;
    if gone_if_missing(marked)? == Outcome::Gone {
        return Ok(Outcome::Gone);
    }
    let outcome = gone_if_missing(pods.delete(&pod.name, &graceful(spec)).await)?;
    if outcome == Outcome::Done {
        info!(node = %node.name_any(), %pod, "deleted with its gang");
    }
    Ok(outcome)
}

/// Conditions merge by type: only ours changes.
pub(super) async fn set_gpu_healthy(
    ctx: &Context,
    node: &Node,
    pod: &PodKey,
    healthy: bool,
    message: &str,
    now: Time,
) -> Carried {
    let patch = json!({"status": {"conditions": [{
        "type": GPU_HEALTHY_READINESS_GATE,
        "status": if healthy { "True" } else { "False" },
        "reason": if healthy { "GpuHealthy" } else { "GpuUnhealthy" },
        "message": message,
        "lastTransitionTime": now,
    }]}});
    let set = api(ctx, pod)
        .patch_status(&pod.name, &patch_params(), &Patch::Strategic(patch))
        .await;
    let outcome = gone_if_missing(set)?;
    if outcome == Outcome::Done {
        info!(node = %node.name_any(), %pod, healthy, "readiness gate {GPU_HEALTHY_READINESS_GATE} set");
    }
    Ok(outcome)
}

fn api(ctx: &Context, pod: &PodKey) -> Api<Pod> {
    Api::namespaced(ctx.client.clone(), &pod.namespace)
}

/// A pod's delete with the policy's grace period (unset: the pod's own).
fn graceful(spec: &GpuHealthPolicySpec) -> DeleteParams {
    DeleteParams {
        grace_period_seconds: grace_seconds(spec),
        ..Default::default()
    }
}

/// The policy's `drain.gracePeriod`, in seconds (unset: the pod's own).
fn grace_seconds(spec: &GpuHealthPolicySpec) -> Option<u32> {
    spec.drain
        .grace_period
        .map(|g| u32::try_from(g.as_std().as_secs()).unwrap_or(u32::MAX))
}
