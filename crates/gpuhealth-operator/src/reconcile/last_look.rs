//! A last look before a reset, reboot or diagnostic is asked for. The step decided
//! from the watches' caches, and a cache can lag behind the API server
//! (seen after the operator was paused: it went on before its watches had
//! delivered what happened meanwhile), so a pod the scheduler gave a
//! covered GPU a moment ago may be missing from what the drain judged.
//! The ResourceClaims are read afresh here; a pod one of them was
//! allocated a covered device for, which the step did not know as a
//! holder, keeps the request back until the next step drains it.

use gpuhealth_engine::{drain::PodView, machine::Action};
use k8s_openapi::api::{core::v1::Pod, resource::v1::ResourceClaim};
use kube::{Api, api::ListParams};

use super::read::Read;
use crate::{context::Context, devices, observe};

/// A pod (`namespace/name`) that holds a GPU `action` acts on, as the
/// API server says now, and that the step did not see holding one.
pub async fn unseen_holder(
    ctx: &Context,
    read: &Read,
    action: &Action,
) -> Result<Option<String>, kube::Error> {
    let covered: Option<&[String]> = match action {
        Action::RequestReset { gpus, .. } | Action::RequestDiagnostics { gpus, .. } => Some(gpus),
        Action::RequestReboot { .. } => None,
        _ => return Ok(None),
    };
    let (Some(_), Some(dra)) = (&ctx.dra, &read.view.dra) else {
        return Ok(None);
    };
    // Devices that name their GPU only: the step knows a holder by the
    // GPU's UUID, so a pod on a device that names none could never be
    // known, and would keep a reboot back for ever.
    let devices: Vec<_> = dra
        .devices
        .iter()
        .filter(|d| {
            d.uuid
                .as_ref()
                .is_some_and(|u| covered.is_none_or(|gpus| gpus.contains(u)))
        })
        .cloned()
        .collect();
    if devices.is_empty() {
        return Ok(None);
    }
    let claims: Api<ResourceClaim> = Api::all(ctx.client.clone());
    let listed = claims.list(&ListParams::default()).await?;
    for (namespace, name) in devices::reserved_among(&listed.items, &devices) {
        if known_holder(&read.pods, &namespace, &name) {
            continue;
        }
        let pods: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
        let Some(pod) = pods.get_opt(&name).await? else {
            continue;
        };
        // As the drain sees it: one leaving or ended holds nothing.
        let seen = observe::pod_view(&pod, &Default::default(), None);
        if !seen.terminating && !seen.finished {
            return Ok(Some(format!("{namespace}/{name}")));
        }
    }
    Ok(None)
}

/// Whether the step judged `namespace/name` as holding a GPU.
fn known_holder(pods: &[PodView], namespace: &str, name: &str) -> bool {
    pods.iter()
        .any(|p| p.namespace == namespace && p.name == name && !p.gpus.is_empty())
}
