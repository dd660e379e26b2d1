//! Actions that write the node: its cordon and the record of who made it,
//! the requests to its agent, its labels, the break-glass annotation and,
//! on a node with no report, its `GpuHealthy` condition.

use gpuhealth_api::{
    contract::{
        AnnotationValue, BREAK_GLASS_ANNOTATION, CORDONED_BY_ANNOTATION, CordonRecord,
        DIAGNOSTICS_REQUEST_ANNOTATION, DiagnosticsLevel, DiagnosticsRequest,
        GPU_HEALTHY_CONDITION, REBOOT_REQUEST_ANNOTATION, RESET_REQUEST_ANNOTATION, RebootRequest,
        RequestId, ResetRequest,
    },
    vocabulary::FindingKind,
};
use k8s_openapi::{api::core::v1::Node, apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use kube::{Api, ResourceExt, api::Patch};
use serde_json::{Value, json};
use tracing::{info, warn};

use super::{Carried, Failure, Outcome, gone_if_missing, patch_params};
use crate::context::Context;

/// Sets `spec.unschedulable` and the record of whose cordon it is in one
/// write.
pub(super) async fn cordon(ctx: &Context, node: &Node, incident: &str, now: Time) -> Carried {
    let record = CordonRecord {
        incident: incident.parse().map_err(Failure::Invalid)?,
        at: now,
    };
    merge(
        ctx,
        node,
        json!({
            "metadata": {"annotations": {CORDONED_BY_ANNOTATION: record.to_annotation()}},
            "spec": {"unschedulable": true},
        }),
    )
    .await?;
    info!(node = %node.name_any(), %incident, "cordoned");
    Ok(Outcome::Done)
}

/// Clears both, guarded by the resourceVersion decided on: if anyone
/// touched the node since, the write fails (409) and the next reconcile
/// decides again.
pub(super) async fn uncordon(ctx: &Context, node: &Node, incident: &str) -> Carried {
    remove_record(ctx, node, true).await?;
    info!(node = %node.name_any(), %incident, "uncordoned");
    Ok(Outcome::Done)
}

/// Guarded like the uncordon: a cordon written since (gpuhealth's own,
/// with a record of its own) is never stripped of its record.
pub(super) async fn forget_cordon_record(ctx: &Context, node: &Node, incident: &str) -> Carried {
    remove_record(ctx, node, false).await?;
    info!(node = %node.name_any(), %incident, "someone else uncordoned the node: gpuhealth's record of its cordon removed");
    Ok(Outcome::Done)
}

/// Removes the record of gpuhealth's cordon (and the cordon, if
/// `uncordon`), only from the node as decided on.
async fn remove_record(ctx: &Context, node: &Node, uncordon: bool) -> Result<(), kube::Error> {
    let mut patch = json!({
        "metadata": {
            "resourceVersion": node.resource_version(),
            "annotations": {CORDONED_BY_ANNOTATION: null},
        },
    });
    if uncordon {
        patch["spec"] = json!({"unschedulable": false});
    }
    merge(ctx, node, patch).await
}

pub(super) async fn request_reset(
    ctx: &Context,
    node: &Node,
    id: &RequestId,
    gpus: &[String],
    requested_at: Timestamp,
) -> Carried {
    let reset = ResetRequest {
        id: id.clone(),
        gpus: gpus.to_vec(),
        requested_at: Time(requested_at),
    };
    reset.check().map_err(|e| Failure::Invalid(e.to_string()))?;
    annotate(ctx, node, RESET_REQUEST_ANNOTATION, &reset.to_annotation()).await?;
    info!(node = %node.name_any(), request = %id, ?gpus, "GPU reset requested");
    Ok(Outcome::Done)
}

pub(super) async fn request_reboot(
    ctx: &Context,
    node: &Node,
    id: &RequestId,
    requested_at: Timestamp,
) -> Carried {
    let reboot = RebootRequest {
        id: id.clone(),
        requested_at: Time(requested_at),
    };
    annotate(
        ctx,
        node,
        REBOOT_REQUEST_ANNOTATION,
        &reboot.to_annotation(),
    )
    .await?;
    info!(node = %node.name_any(), request = %id, "reboot requested");
    Ok(Outcome::Done)
}

pub(super) async fn request_diagnostics(
    ctx: &Context,
    node: &Node,
    id: &RequestId,
    gpus: &[String],
    level: DiagnosticsLevel,
    timeout: gpuhealth_api::Duration,
    requested_at: Timestamp,
) -> Carried {
    let diagnose = DiagnosticsRequest {
        id: id.clone(),
        gpus: gpus.to_vec(),
        level,
        timeout,
        requested_at: Time(requested_at),
    };
    diagnose
        .check()
        .map_err(|e| Failure::Invalid(e.to_string()))?;
    let value = diagnose.to_annotation();
    annotate(ctx, node, DIAGNOSTICS_REQUEST_ANNOTATION, &value).await?;
    info!(node = %node.name_any(), request = %id, ?gpus, %level, "DCGM diagnostic requested");
    Ok(Outcome::Done)
}

pub(super) async fn clear_break_glass(ctx: &Context, node: &Node) -> Carried {
    merge(
        ctx,
        node,
        json!({"metadata": {"annotations": {BREAK_GLASS_ANNOTATION: null}}}),
    )
    .await?;
    warn!(node = %node.name_any(), "break glass recorded and cleared");
    Ok(Outcome::Done)
}

pub(super) async fn label(ctx: &Context, node: &Node, key: &str, value: &str) -> Carried {
    merge(ctx, node, json!({"metadata": {"labels": {key: value}}})).await?;
    warn!(node = %node.name_any(), %key, %value, "labelled for replacement");
    Ok(Outcome::Done)
}

/// `GpuHealthy=Unknown`, reason `NoReport`: all the operator may write of
/// that condition (admission holds it to that, on a node with no report).
/// Guarded by the resourceVersion decided on, so that a report written
/// since (and the agent's own condition with it) is never contradicted: a
/// conflict fails the write and the next reconcile decides again.
pub(super) async fn mark_gpu_health_unknown(
    ctx: &Context,
    node: &Node,
    message: &str,
    now: Time,
) -> Carried {
    let patch = json!({
        "metadata": {"resourceVersion": node.resource_version()},
        "status": {"conditions": [{
            "type": GPU_HEALTHY_CONDITION,
            "status": "Unknown",
            "reason": FindingKind::NoReport.as_str(),
            "message": message,
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }]},
    });
    let result = Api::<Node>::all(ctx.client.clone())
        .patch_status(&node.name_any(), &patch_params(), &Patch::Strategic(patch))
        .await;
    let outcome = gone_if_missing(result)?;
    info!(node = %node.name_any(), "no GPU report: its GpuHealthy condition set Unknown");
    Ok(outcome)
}

async fn annotate(ctx: &Context, node: &Node, key: &str, value: &str) -> Result<(), kube::Error> {
    merge(
        ctx,
        node,
        json!({"metadata": {"annotations": {key: value}}}),
    )
    .await
}

async fn merge(ctx: &Context, node: &Node, patch: Value) -> Result<(), kube::Error> {
    Api::<Node>::all(ctx.client.clone())
        .patch(&node.name_any(), &patch_params(), &Patch::Merge(patch))
        .await?;
    Ok(())
}
