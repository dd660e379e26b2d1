//! The validation pod: created from the policy's template, pinned to the
//! node, and deleted once read.

use gpuhealth_api::policy::GpuHealthPolicySpec;
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::{Api, Resource, ResourceExt, api::DeleteParams, runtime::events::EventType};
use tracing::{info, warn};

use super::{Carried, Outcome, gone_if_missing, post_params, publish};
use crate::{context::Context, validation};

/// One that exists already (409) is left as it is. One the API server
/// refuses (or a template that cannot be built) is [`Outcome::Refused`]
/// with a Warning Event: verification then fails at its timeout.
pub(super) async fn create(
    ctx: &Context,
    node: &Node,
    spec: &GpuHealthPolicySpec,
    pod: &str,
) -> Carried {
    let Some(template) = &spec.verification.validation_pod else {
        return Ok(Outcome::Gone);
    };
    let name = node.name_any();
    let ns = &ctx.validation.namespace;
    let why = match validation::build(template, pod, &ctx.validation, &name) {
        Ok(p) => {
            let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), ns);
            match pods.create(&post_params(), &p).await {
                Ok(_) => {
                    info!(node = %name, namespace = %ns, %pod, "validation pod created");
                    return Ok(Outcome::Done);
                }
                Err(kube::Error::Api(s)) if s.code == 409 => return Ok(Outcome::Gone),
                Err(kube::Error::Api(s)) if matches!(s.code, 400 | 403 | 404 | 422) => s.message,
                Err(e) => return Err(e.into()),
            }
        }
        Err(e) => e.to_string(),
    };
    let message = format!(
        "validation pod {ns}/{pod} from verification.validationPod.template was refused: {why}; verification fails at its timeout"
    );
    warn!(node = %name, %message);
    let about = node.object_ref(&());
    publish(
        ctx,
        &about,
        EventType::Warning,
        "ValidationPodRefused",
        message,
    )
    .await;
    Ok(Outcome::Refused)
}

pub(super) async fn delete(ctx: &Context, spec: &GpuHealthPolicySpec, pod: &str) -> Carried {
    if spec.verification.validation_pod.is_none() {
        return Ok(Outcome::Gone);
    }
    let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &ctx.validation.namespace);
    gone_if_missing(pods.delete(pod, &DeleteParams::default()).await)
}
