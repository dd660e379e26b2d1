//! Carrying out the engine's actions. Each is idempotent: the same action
//! twice leaves the cluster as once.

use gpuhealth_api::{
    contract::{
        AnnotationValue, BREAK_GLASS_ANNOTATION, CORDONED_BY_ANNOTATION, CordonRecord,
        DIAGNOSTICS_REQUEST_ANNOTATION, DiagnosticsRequest, GPU_HEALTHY_READINESS_GATE,
        REBOOT_REQUEST_ANNOTATION, RESET_REQUEST_ANNOTATION, RebootRequest, RequestId,
        ResetRequest,
    },
    gang::{DISRUPTION_PENDING_CONDITION, DISRUPTION_TARGET_REASON, EVICT_AT_ANNOTATION},
    policy::GpuHealthPolicySpec,
};
use gpuhealth_engine::machine::Action;
use k8s_openapi::{
    api::core::v1::{Node, ObjectReference, Pod},
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::Timestamp,
};
use kube::{
    Api, Resource, ResourceExt,
    api::{DeleteParams, EvictParams, Patch, PatchParams, PostParams},
    runtime::events::EventType as KubeEventType,
};
use serde_json::json;
use tracing::{info, warn};

use crate::{
    context::{Context, Error, MANAGER},
    fences, validation,
};

/// Carries out `action`, counting it by outcome in the metrics.
pub async fn run(
    ctx: &Context,
    node: &Node,
    spec: &GpuHealthPolicySpec,
    action: &Action,
) -> Result<(), Error> {
    let label = match action {
        Action::Cordon { .. } => "cordon",
        Action::Uncordon { .. } => "uncordon",
        Action::ForgetCordonRecord { .. } => "forget_cordon_record",
        Action::Evict { .. } => "evict",
        Action::ForceDelete { .. } => "force_delete",
        Action::TellGangMember { .. } => "tell_gang_member",
        Action::EvictGangMember { .. } => "evict_gang_member",
        Action::RequestReset { .. } => "request_reset",
        Action::RequestReboot { .. } => "request_reboot",
        Action::LabelNode { .. } => "label_node",
        Action::ClearBreakGlass => "clear_break_glass",
        Action::RequestDiagnostics { .. } => "request_diagnostics",
        Action::CreateValidationPod { .. } => "create_validation_pod",
        Action::DeleteValidationPod { .. } => "delete_validation_pod",
        Action::SetGpuHealthy { .. } => "set_gpu_healthy",
        Action::TaintDevice { .. } => "taint_device",
        Action::UntaintDevice { .. } => "untaint_device",
    };
    let result = carry_out(ctx, node, spec, action).await;
    let outcome = match &result {
        Ok(outcome) => *outcome,
        Err(_) => "error",
    };
    ctx.metrics.action(label, outcome);
    result.map(|_| ())
}

/// A pod's delete with the policy's grace period (unset: the pod's own).
fn graceful(spec: &GpuHealthPolicySpec) -> DeleteParams {
    DeleteParams {
        grace_period_seconds: spec
            .drain
            .grace_period
            .map(|g| u32::try_from(g.as_std().as_secs()).unwrap_or(u32::MAX)),
        ..Default::default()
    }
}

/// What happened: `done`, `refused` (a disruption budget said not now),
/// `gone` (nothing left to do) or `failed` (best effort, not retried).
async fn carry_out(
    ctx: &Context,
    node: &Node,
    spec: &GpuHealthPolicySpec,
    action: &Action,
) -> Result<&'static str, Error> {
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
                .patch(&name, &patch_params(), &Patch::Merge(patch))
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
                .patch(&name, &patch_params(), &Patch::Merge(patch))
                .await?;
            info!(node = %name, %incident, "uncordoned");
        }
        Action::ForgetCordonRecord { incident } => {
            // Guarded like the uncordon: a cordon written since (gpuhealth's
            // own, with a record of its own) is never stripped of its record.
            let patch = json!({
                "metadata": {
                    "resourceVersion": node.resource_version(),
                    "annotations": {CORDONED_BY_ANNOTATION: null},
                },
            });
            nodes
                .patch(&name, &patch_params(), &Patch::Merge(patch))
                .await?;
            info!(node = %name, %incident, "someone else uncordoned the node: gpuhealth's record of its cordon removed");
        }
        Action::Evict { pod } => {
            let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &pod.namespace);
            match pods
                .evict(
                    &pod.name,
                    &EvictParams {
                        post_options: post_params(),
                        delete_options: Some(graceful(spec)),
                    },
                )
                .await
            {
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
        Action::TellGangMember { pod, at, why } => {
            let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &pod.namespace);
            // The annotation for the pod's own processes (the downward API
            // mounts it), the condition for whoever watches the pod.
            let patch = json!({"metadata": {"annotations": {EVICT_AT_ANNOTATION: Time(*at)}}});
            match pods
                .patch(&pod.name, &patch_params(), &Patch::Merge(patch))
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => return Ok("gone"),
                Err(e) => return Err(e.into()),
            }
            let condition = json!({"status": {"conditions": [{
                "type": DISRUPTION_PENDING_CONDITION,
                "status": "True",
                "reason": "GangEvictionScheduled",
                "message": why,
                "lastTransitionTime": now,
            }]}});
            match pods
                .patch_status(&pod.name, &patch_params(), &Patch::Strategic(condition))
                .await
            {
                Ok(_) => info!(node = %name, %pod, at = %at, "told it leaves with its gang"),
                Err(kube::Error::Api(s)) if s.code == 404 => return Ok("gone"),
                Err(e) => return Err(e.into()),
            }
        }
        Action::EvictGangMember { pod, why } => {
            let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &pod.namespace);
            // As the API server marks a pod it evicts: a Job's
            // podFailurePolicy can ignore the restart this causes.
            let condition = json!({"status": {"conditions": [{
                "type": "DisruptionTarget",
                "status": "True",
                "reason": DISRUPTION_TARGET_REASON,
                "message": why,
                "lastTransitionTime": now,
            }]}});
            match pods
                .patch_status(&pod.name, &patch_params(), &Patch::Strategic(condition))
                .await
            {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => return Ok("gone"),
                Err(e) => return Err(e.into()),
            }
            match pods.delete(&pod.name, &graceful(spec)).await {
                Ok(_) => info!(node = %name, %pod, "deleted with its gang"),
                Err(kube::Error::Api(s)) if s.code == 404 => return Ok("gone"),
                Err(e) => return Err(e.into()),
            }
        }
        Action::ForceDelete { pod } => {
            let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &pod.namespace);
            match pods
                .delete(
                    &pod.name,
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
        Action::RequestReset {
            id: request,
            gpus,
            requested_at,
        } => {
            let reset = ResetRequest {
                id: request.clone(),
                gpus: gpus.clone(),
                requested_at: Time(*requested_at),
            };
            reset
                .check()
                .map_err(|e| Error::InvalidRequest(e.to_string()))?;
            let value = reset.to_annotation();
            annotate(&nodes, &name, RESET_REQUEST_ANNOTATION, &value).await?;
            info!(node = %name, %request, ?gpus, "GPU reset requested");
        }
        Action::RequestReboot {
            id: request,
            requested_at,
        } => {
            let value = RebootRequest {
                id: request.clone(),
                requested_at: Time(*requested_at),
            }
            .to_annotation();
            annotate(&nodes, &name, REBOOT_REQUEST_ANNOTATION, &value).await?;
            info!(node = %name, %request, "reboot requested");
        }
        Action::RequestDiagnostics {
            id: request,
            gpus,
            level,
            timeout,
            requested_at,
        } => {
            let diagnose = DiagnosticsRequest {
                id: request.clone(),
                gpus: gpus.clone(),
                level: *level,
                timeout: *timeout,
                requested_at: Time(*requested_at),
            };
            diagnose
                .check()
                .map_err(|e| Error::InvalidRequest(e.to_string()))?;
            let value = diagnose.to_annotation();
            annotate(&nodes, &name, DIAGNOSTICS_REQUEST_ANNOTATION, &value).await?;
            info!(node = %name, %request, ?gpus, %level, "DCGM diagnostic requested");
        }
        Action::SetGpuHealthy {
            pod,
            healthy,
            message,
        } => {
            let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &pod.namespace);
            // Conditions merge by type: only ours changes.
            let patch = json!({"status": {"conditions": [{
                "type": GPU_HEALTHY_READINESS_GATE,
                "status": if *healthy { "True" } else { "False" },
                "reason": if *healthy { "GpuHealthy" } else { "GpuUnhealthy" },
                "message": message,
                "lastTransitionTime": now,
            }]}});
            match pods
                .patch_status(&pod.name, &patch_params(), &Patch::Strategic(patch))
                .await
            {
                Ok(_) => {
                    info!(node = %name, %pod, healthy, "readiness gate {GPU_HEALTHY_READINESS_GATE} set")
                }
                Err(kube::Error::Api(s)) if s.code == 404 => return Ok("gone"),
                Err(e) => return Err(e.into()),
            }
        }
        Action::ClearBreakGlass => {
            let patch = json!({"metadata": {"annotations": {BREAK_GLASS_ANNOTATION: null}}});
            nodes
                .patch(&name, &patch_params(), &Patch::Merge(patch))
                .await?;
            warn!(node = %name, "break glass recorded and cleared");
        }
        Action::LabelNode { key, value } => {
            let patch = json!({"metadata": {"labels": {key: value}}});
            nodes
                .patch(&name, &patch_params(), &Patch::Merge(patch))
                .await?;
            warn!(node = %name, %key, %value, "labelled for replacement");
        }
        Action::CreateValidationPod { name: pod } => {
            let Some(template) = &spec.verification.validation_pod else {
                return Ok("gone");
            };
            let ns = &ctx.validation.namespace;
            let refused = match validation::build(template, pod, &ctx.validation, &name) {
                Ok(p) => {
                    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
                    match pods.create(&post_params(), &p).await {
                        Ok(_) => {
                            info!(node = %name, namespace = %ns, %pod, "validation pod created");
                            None
                        }
                        Err(kube::Error::Api(s)) if s.code == 409 => None,
                        Err(kube::Error::Api(s)) if matches!(s.code, 400 | 403 | 404 | 422) => {
                            Some(s.message)
                        }
                        Err(e) => return Err(e.into()),
                    }
                }
                Err(e) => Some(e.to_string()),
            };
            if let Some(why) = refused {
                let message = format!(
                    "validation pod {ns}/{pod} from verification.validationPod.template was refused: {why}; verification fails at its timeout"
                );
                warn!(node = %name, %message);
                publish(
                    ctx,
                    &node.object_ref(&()),
                    KubeEventType::Warning,
                    "ValidationPodRefused",
                    message,
                )
                .await;
                return Ok("refused");
            }
        }
        Action::TaintDevice {
            rule,
            device,
            incident,
        } => {
            let served = served_rules(ctx)?;
            let object =
                fences::rule(served.version, rule, device, incident, &name).ok_or_else(|| {
                    Error::InvalidRequest(format!("device {device:?} is not driver/pool/device"))
                })?;
            match served
                .api(&ctx.client)
                .create(&post_params(), &object)
                .await
            {
                Ok(_) => info!(node = %name, rule, device, "fenced a GPU"),
                Err(kube::Error::Api(s)) if s.code == 409 => return Ok("gone"),
                Err(e) => return Err(e.into()),
            }
        }
        Action::UntaintDevice { rule } => {
            match served_rules(ctx)?
                .api(&ctx.client)
                .delete(rule, &DeleteParams::default())
                .await
            {
                Ok(_) => info!(node = %name, rule, "lifted a GPU's fence"),
                Err(kube::Error::Api(s)) if s.code == 404 => return Ok("gone"),
                Err(e) => return Err(e.into()),
            }
        }
        Action::DeleteValidationPod { name: pod } => {
            if spec.verification.validation_pod.is_none() {
                return Ok("gone");
            }
            let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ctx.validation.namespace);
            match pods.delete(pod, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => return Ok("gone"),
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok("done")
}

/// gpuhealth's rules and their version; an error where the cluster serves
/// none (the engine fences no GPU there).
fn served_rules(ctx: &Context) -> Result<&fences::Rules, Error> {
    ctx.dra
        .as_ref()
        .and_then(|d| d.rules.as_ref())
        .ok_or_else(|| Error::InvalidRequest("the cluster serves no DeviceTaintRules".into()))
}

/// Publishes an Event about `about`. Events are best effort: a lost one
/// must not stop remediation. False if it was lost.
pub async fn publish(
    ctx: &Context,
    about: &ObjectReference,
    type_: KubeEventType,
    reason: &str,
    message: String,
) -> bool {
    match ctx
        .events
        .publish(about, type_, reason, "Remediate", &message)
        .await
    {
        Ok(()) => true,
        Err(e) => {
            warn!(about = ?about.name, error = %e, "could not publish an Event");
            false
        }
    }
}

async fn annotate(nodes: &Api<Node>, name: &str, key: &str, value: &str) -> Result<(), Error> {
    let patch = json!({"metadata": {"annotations": {key: value}}});
    nodes
        .patch(name, &patch_params(), &Patch::Merge(patch))
        .await?;
    Ok(())
}

fn id(raw: &str) -> Result<RequestId, Error> {
    raw.parse().map_err(Error::InvalidRequest)
}

/// Every write names gpuhealth as its field manager, so that `managedFields`
/// and the audit log tell its cordon from anyone else's.
fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(MANAGER.to_owned()),
        ..PatchParams::default()
    }
}

fn post_params() -> PostParams {
    PostParams {
        field_manager: Some(MANAGER.to_owned()),
        ..PostParams::default()
    }
}
