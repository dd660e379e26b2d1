//! Carrying out the engine's actions. Each is idempotent: the same action
//! twice leaves the cluster as once.

use gpuhealth_api::contract::{
    AnnotationValue, CORDONED_BY_ANNOTATION, CordonRecord, REBOOT_REQUEST_ANNOTATION,
    REPLACE_LABEL, RESET_REQUEST_ANNOTATION, RebootRequest, RequestId, ResetRequest,
};
use gpuhealth_engine::machine::{Action, EventType};
use k8s_openapi::{
    api::core::v1::{Node, Pod},
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::Timestamp,
};
use kube::{
    Api, Resource, ResourceExt,
    api::{DeleteParams, EvictParams, Patch, PatchParams},
    runtime::events::{Event, EventType as KubeEventType},
};
use serde_json::json;
use tracing::{info, warn};

use crate::context::{Context, Error};

/// Carries out `action`, counting it by outcome in the metrics.
pub async fn run(ctx: &Context, node: &Node, action: &Action) -> Result<(), Error> {
    let label = match action {
        Action::Cordon { .. } => "cordon",
        Action::Uncordon { .. } => "uncordon",
        Action::Evict { .. } => "evict",
        Action::ForceDelete { .. } => "force_delete",
        Action::RequestReset { .. } => "request_reset",
        Action::RequestReboot { .. } => "request_reboot",
        Action::MarkForReplacement { .. } => "mark_for_replacement",
        Action::Event { .. } => "event",
    };
    let result = carry_out(ctx, node, action).await;
    let outcome = match &result {
        Ok(outcome) => *outcome,
        Err(_) => "error",
    };
    ctx.metrics.action(label, outcome);
    result.map(|_| ())
}

/// What happened: `done`, `refused` (a disruption budget said not now),
/// `gone` (nothing left to do) or `failed` (best effort, not retried).
async fn carry_out(ctx: &Context, node: &Node, action: &Action) -> Result<&'static str, Error> {
    let name = node.name_any();
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    let now = Time(Timestamp::now());
    match action {
        Action::Cordon { incident } => {
            let record = CordonRecord {
                incident: id(incident)?,
                at: now,
            };
            // One write: the cordon and the record of who made it.
            let patch = json!({
                "metadata": {"annotations": {CORDONED_BY_ANNOTATION: record.to_annotation()}},
                "spec": {"unschedulable": true},
            });
            nodes
                .patch(&name, &PatchParams::default(), &Patch::Merge(patch))
                .await?;
            info!(node = %name, %incident, "cordoned");
        }
        Action::Uncordon { incident } => {
            // Guarded by the resourceVersion we decided on: if anyone touched
            // the node since, the write fails and the next reconcile decides again.
            let patch = json!({
                "metadata": {
                    "resourceVersion": node.resource_version(),
                    "annotations": {CORDONED_BY_ANNOTATION: null},
                },
                "spec": {"unschedulable": false},
            });
            nodes
                .patch(&name, &PatchParams::default(), &Patch::Merge(patch))
                .await?;
            info!(node = %name, %incident, "uncordoned");
        }
        Action::Evict { pod } => {
            let (ns, pod_name) = pod.split_once('/').unwrap_or(("", pod));
            let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
            match pods.evict(pod_name, &EvictParams::default()).await {
                Ok(_) => info!(node = %name, %pod, "evicted"),
                // A PodDisruptionBudget says not now: try again next time, never force.
                Err(kube::Error::Api(s)) if s.code == 429 => {
                    info!(node = %name, %pod, "eviction refused by a disruption budget; will retry");
                    return Ok("refused");
                }
                Err(kube::Error::Api(s)) if s.code == 404 => return Ok("gone"),
                Err(e) => return Err(e.into()),
            }
        }
        Action::ForceDelete { pod } => {
            let (ns, pod_name) = pod.split_once('/').unwrap_or(("", pod));
            let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
            match pods
                .delete(
                    pod_name,
                    &DeleteParams {
                        grace_period_seconds: Some(0),
                        ..Default::default()
                    },
                )
                .await
            {
                Ok(_) => {
                    warn!(node = %name, %pod, "force-deleted after the drain timeout, as the policy allows")
                }
                Err(kube::Error::Api(s)) if s.code == 404 => return Ok("gone"),
                Err(e) => return Err(e.into()),
            }
        }
        Action::RequestReset { id: request, gpus } => {
            let value = ResetRequest {
                id: id(request)?,
                gpus: gpus.clone(),
                requested_at: now,
            }
            .to_annotation();
            annotate(&nodes, &name, RESET_REQUEST_ANNOTATION, &value).await?;
            info!(node = %name, %request, ?gpus, "GPU reset requested");
        }
        Action::RequestReboot { id: request } => {
            let value = RebootRequest {
                id: id(request)?,
                requested_at: now,
            }
            .to_annotation();
            annotate(&nodes, &name, REBOOT_REQUEST_ANNOTATION, &value).await?;
            info!(node = %name, %request, "reboot requested");
        }
        Action::MarkForReplacement { incident } => {
            let patch = json!({"metadata": {"labels": {REPLACE_LABEL: incident}}});
            nodes
                .patch(&name, &PatchParams::default(), &Patch::Merge(patch))
                .await?;
            warn!(node = %name, %incident, "handed off for replacement");
        }
        Action::Event {
            type_,
            reason,
            message,
        } => {
            let event = Event {
                type_: match type_ {
                    EventType::Normal => KubeEventType::Normal,
                    EventType::Warning => KubeEventType::Warning,
                },
                reason: reason.clone(),
                note: Some(message.chars().take(1000).collect()),
                action: "Remediate".into(),
                secondary: None,
            };
            // Events are best effort: a lost one must not stop remediation.
            if let Err(e) = ctx.recorder.publish(&event, &node.object_ref(&())).await {
                warn!(node = %name, error = %e, "could not publish an Event");
                return Ok("failed");
            }
        }
    }
    Ok("done")
}

async fn annotate(nodes: &Api<Node>, name: &str, key: &str, value: &str) -> Result<(), Error> {
    let patch = json!({"metadata": {"annotations": {key: value}}});
    nodes
        .patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await?;
    Ok(())
}

fn id(raw: &str) -> Result<RequestId, Error> {
    raw.parse().map_err(Error::InvalidId)
}
