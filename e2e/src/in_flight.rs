//! Playing the operator's part before a request, for tests of the agent
//! alone: the agent carries out only the request that the node's
//! `GpuNodeHealth` records in flight, on a node cordoned for its incident.

use gpuhealth_api::{
    GpuNodeHealth, GpuNodeHealthSpec, RecoveryAction,
    contract::{AnnotationValue, CordonRecord, RESET_REQUEST_ANNOTATION, ResetRequest},
};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use kube::{
    Api, Client,
    api::{Patch, PatchParams, PostParams},
};
use serde_json::json;

/// The incident a request id names: `inc-1-reset-2` → `inc-1`.
pub fn incident_of(id: &str) -> &str {
    id.rsplitn(3, '-').last().unwrap_or(id)
}

/// Records `id` in flight in `node`'s `GpuNodeHealth` (created if missing),
/// then cordons the node with gpuhealth's record for its incident: the
/// operator's order, so that a request written after this is one the agent
/// carries out.
pub async fn record(
    client: &Client,
    node: &str,
    action: RecoveryAction,
    id: &str,
    gpus: &[String],
) -> crate::Result<()> {
    crate::crds::install(client).await?;
    let records: Api<GpuNodeHealth> = Api::all(client.clone());
    if records.get_opt(node).await?.is_none() {
        let record = GpuNodeHealth::new(node, GpuNodeHealthSpec {});
        records.create(&PostParams::default(), &record).await?;
    }
    let incident = incident_of(id);
    let now = Time(Timestamp::now());
    let status = json!({"status": {
        "phase": "Remediating",
        "incident": incident,
        "action": {
            "id": id, "type": action, "attempt": 1, "gpus": gpus,
            "startedAt": now, "requestedAt": now,
        },
    }});
    records
        .patch_status(node, &PatchParams::default(), &Patch::Merge(status))
        .await?;
    let cordon = CordonRecord {
        incident: incident
            .parse()
            .map_err(|e| crate::HarnessError::Invalid(format!("request id {id}: {e}")))?,
        at: now,
    };
    let patch = json!({
        "spec": {"unschedulable": true},
        "metadata": {"annotations": {CordonRecord::ANNOTATION: cordon.to_annotation()}},
    });
    Api::<k8s_openapi::api::core::v1::Node>::all(client.clone())
        .patch(node, &PatchParams::default(), &Patch::Merge(patch))
        .await?;
    Ok(())
}

/// A reset request as the operator makes it: recorded in flight first,
/// then written to the Node.
pub async fn request_reset(
    client: &Client,
    node: &str,
    id: &str,
    gpu: &str,
    at: Timestamp,
) -> crate::Result<()> {
    record(
        client,
        node,
        RecoveryAction::GpuReset,
        id,
        &[gpu.to_owned()],
    )
    .await?;
    let request = ResetRequest {
        id: id
            .parse()
            .map_err(|e| crate::HarnessError::Invalid(format!("request id {id}: {e}")))?,
        gpus: vec![gpu.to_owned()],
        requested_at: Time(at),
    };
    let patch =
        json!({"metadata": {"annotations": {RESET_REQUEST_ANNOTATION: request.to_annotation()}}});
    Api::<k8s_openapi::api::core::v1::Node>::all(client.clone())
        .patch(node, &PatchParams::default(), &Patch::Merge(patch))
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_request_names_its_incident() {
        assert_eq!(super::incident_of("inc-1-reset-2"), "inc-1");
        assert_eq!(
            super::incident_of("inc-1764547200-n3-reboot-1"),
            "inc-1764547200-n3"
        );
    }
}
