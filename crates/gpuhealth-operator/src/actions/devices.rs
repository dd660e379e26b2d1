//! A GPU's fence: gpuhealth's `DeviceTaintRule` for it.

use gpuhealth_api::vocabulary::DeviceId;
use k8s_openapi::api::core::v1::Node;
use kube::{ResourceExt, api::DeleteParams};
use tracing::info;

use super::{Carried, Failure, Outcome, gone_if_missing, post_params};
use crate::{context::Context, fences};

/// One that exists already (409) is left as it is.
pub(super) async fn taint(
    ctx: &Context,
    node: &Node,
    rule: &str,
    device: &DeviceId,
    incident: &str,
) -> Carried {
    let name = node.name_any();
    let served = served_rules(ctx)?;
    let object = fences::rule(served.version, rule, device, incident, &name);
    match served
        .api(&ctx.client)
        .create(&post_params(), &object)
        .await
    {
        Ok(_) => {
            info!(node = %name, rule, %device, "fenced a GPU");
            Ok(Outcome::Done)
        }
        Err(kube::Error::Api(s)) if s.code == 409 => Ok(Outcome::Gone),
        Err(e) => Err(e.into()),
    }
}

/// One already gone is done.
pub(super) async fn untaint(ctx: &Context, node: &Node, rule: &str) -> Carried {
    let deleted = served_rules(ctx)?
        .api(&ctx.client)
        .delete(rule, &DeleteParams::default())
        .await;
    let outcome = gone_if_missing(deleted)?;
    if outcome == Outcome::Done {
        info!(node = %node.name_any(), rule, "lifted a GPU's fence");
    }
    Ok(outcome)
}

/// gpuhealth's rules and their version; refused where the cluster serves
/// none (the engine fences no GPU there).
fn served_rules(ctx: &Context) -> Result<&fences::Rules, Failure> {
    ctx.dra
        .as_ref()
        .and_then(|d| d.rules.as_ref())
        .ok_or_else(|| Failure::Invalid("the cluster serves no DeviceTaintRules".into()))
}
