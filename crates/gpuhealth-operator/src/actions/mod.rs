//! Carrying out the engine's actions, one function each, by the object
//! they write: the node ([`node`]), pods ([`pods`]), the validation pod
//! ([`validation_pod`]) and DRA device taints ([`devices`]). Each is
//! idempotent: the same action twice leaves the cluster as once.

mod devices;
mod node;
mod pods;
mod validation_pod;

use gpuhealth_api::policy::GpuHealthPolicySpec;
use gpuhealth_engine::machine::Action;
use k8s_openapi::{
    api::core::v1::{Node, ObjectReference},
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::Timestamp,
};
use kube::{
    ResourceExt,
    api::{PatchParams, PostParams},
    runtime::events::EventType as KubeEventType,
};
use tracing::warn;

use crate::context::{Context, Error, MANAGER};

/// How an action ended, when it did not fail: the `outcome` label of its
/// metric (a failure's is `error`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Written.
    Done,
    /// Not now (a disruption budget's 429, a validation pod refused): the
    /// engine sees it was not done, and the next step decides again.
    Refused,
    /// Nothing left to do: the object is gone, or already as wanted.
    Gone,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Done => "done",
            Outcome::Refused => "refused",
            Outcome::Gone => "gone",
        }
    }
}

/// Why an action could not be carried out; [`run`] names the node and
/// the action.
enum Failure {
    Api(kube::Error),
    Invalid(String),
}

impl From<kube::Error> for Failure {
    fn from(e: kube::Error) -> Self {
        Failure::Api(e)
    }
}

type Carried = Result<Outcome, Failure>;

/// Carries out `action` on `node`, counting it by outcome in the metrics.
pub async fn run(
    ctx: &Context,
    node: &Node,
    spec: &GpuHealthPolicySpec,
    action: &Action,
) -> Result<Outcome, Error> {
    let kind = action.kind();
    let result = carry_out(ctx, node, spec, action).await;
    ctx.metrics.action(
        kind.as_str(),
        result.as_ref().map_or("error", |o| o.as_str()),
    );
    let node = node.name_any();
    result.map_err(|failure| match failure {
        Failure::Api(source) => Error::Act {
            node,
            action: kind,
            source,
        },
        Failure::Invalid(why) => Error::InvalidRequest {
            node,
            action: kind,
            why,
        },
    })
}

async fn carry_out(
    ctx: &Context,
    node: &Node,
    spec: &GpuHealthPolicySpec,
    action: &Action,
) -> Carried {
    let now = Time(Timestamp::now());
    match action {
        Action::Cordon { incident } => node::cordon(ctx, node, incident, now).await,
        Action::Uncordon { incident } => node::uncordon(ctx, node, incident).await,
        Action::ForgetCordonRecord { incident } => {
            node::forget_cordon_record(ctx, node, incident).await
        }
        Action::RequestReset {
            id,
            gpus,
            requested_at,
        } => node::request_reset(ctx, node, id, gpus, *requested_at).await,
        Action::RequestReboot { id, requested_at } => {
            node::request_reboot(ctx, node, id, *requested_at).await
        }
        Action::RequestDiagnostics {
            id,
            gpus,
            level,
            timeout,
            requested_at,
        } => node::request_diagnostics(ctx, node, id, gpus, *level, *timeout, *requested_at).await,
        Action::ClearBreakGlass => node::clear_break_glass(ctx, node).await,
        Action::LabelNode { key, value } => node::label(ctx, node, key, value).await,
        Action::MarkGpuHealthUnknown { message } => {
            node::mark_gpu_health_unknown(ctx, node, message, now).await
        }
        Action::Evict { pod } => pods::evict(ctx, node, spec, pod).await,
        Action::ForceDelete { pod } => pods::force_delete(ctx, node, pod).await,
        Action::TellGangMember { pod, at, why } => {
            pods::tell_gang_member(ctx, node, pod, *at, why, now).await
        }
        Action::EvictGangMember { pod, why } => {
            pods::evict_gang_member(ctx, node, spec, pod, why, now).await
        }
        Action::SetGpuHealthy {
            pod,
            healthy,
            message,
        } => pods::set_gpu_healthy(ctx, node, pod, *healthy, message, now).await,
        Action::CreateValidationPod { name } => validation_pod::create(ctx, node, spec, name).await,
        Action::DeleteValidationPod { name } => validation_pod::delete(ctx, spec, name).await,
        Action::TaintDevice {
            rule,
            device,
            incident,
        } => devices::taint(ctx, node, rule, device, incident).await,
        Action::UntaintDevice { rule } => devices::untaint(ctx, node, rule).await,
    }
}

/// 404 is [`Outcome::Gone`]; any other refusal fails the action.
fn gone_if_missing<T>(result: Result<T, kube::Error>) -> Carried {
    match result {
        Ok(_) => Ok(Outcome::Done),
        Err(kube::Error::Api(s)) if s.code == 404 => Ok(Outcome::Gone),
        Err(e) => Err(e.into()),
    }
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

#[cfg(test)]
mod tests;
