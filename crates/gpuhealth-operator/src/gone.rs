//! Nodes deleted from the cluster: their health records. A record is not
//! owned by its Node (garbage collection would take an incident's record
//! with the Node, and with it the last word on a request in flight), so
//! this looks at every record whose Node is gone, on each deletion seen,
//! after each relist, and every minute: the engine says whether it goes,
//! stays as it is, or records the incident failed with its node
//! (`gpuhealth_engine::machine::node_deleted`).

use std::time::Duration;

use futures::{StreamExt, channel::mpsc::UnboundedReceiver};
use gpuhealth_api::{GpuHealthPolicy, GpuNodeHealth, policy::GpuHealthPolicySpec};
use gpuhealth_engine::machine::{Gone, NodeView, node_deleted};
use k8s_openapi::{
    api::core::v1::{Node, ObjectReference},
    jiff::Timestamp,
};
use kube::{
    Api, ResourceExt,
    api::{DeleteParams, Patch, PatchParams},
    runtime::reflector::ObjectRef,
};
use serde_json::json;
use tracing::{debug, info, warn};

use crate::{
    account, actions,
    context::{Context, Error},
    fences,
    reconcile::write_status,
};

/// How often every record is looked at again, whatever the watch said.
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// Looks at the records of deleted nodes whenever `deleted` says one went
/// (or the node watch relisted), and every minute, while this replica leads.
pub async fn watch(ctx: &Context, mut deleted: UnboundedReceiver<()>) {
    // Not before the nodes have been listed: an empty store would make
    // every record look like a deleted node's (each then costs a GET).
    // Polled: the store's own readiness never woke this task.
    while ctx.nodes.state().is_empty() {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    debug!("looking at the records of deleted nodes");
    loop {
        if ctx.leadership.is_held() {
            sweep(ctx).await;
        }
        tokio::select! {
            more = deleted.next() => if more.is_none() { return },
            () = tokio::time::sleep(SWEEP_EVERY) => {}
        }
        // Several deletions at once are one sweep.
        while deleted.try_recv().is_ok() {}
    }
}

async fn sweep(ctx: &Context) {
    // What this process remembers of a node goes with it; a deleted
    // node's decision still to be recorded is its record's, below.
    let still_there = |node: &str| {
        ctx.nodes.get(&ObjectRef::new(node)).is_some()
            || ctx.node_health.get(&ObjectRef::new(node)).is_some()
    };
    ctx.memory.forget_gone(still_there);
    ctx.gpu_tables.forget_gone(still_there);
    ctx.failures.forget_gone(still_there);
    let records = ctx.node_health.state();
    debug!(
        records = records.len(),
        "sweeping the records of deleted nodes"
    );
    for record in records {
        let name = record.name_any();
        let result = if ctx.nodes.get(&ObjectRef::new(&name)).is_some() {
            unowned(ctx, &record).await
        } else {
            gone(ctx, &record).await
        };
        if let Err(e) = result {
            warn!(node = %name, error = %e, "the record of a deleted node: will look again");
        }
    }
}

/// Records written before they stopped being owned by their Node lose
/// that owner, once, so that deleting the Node leaves them to [`gone`].
async fn unowned(ctx: &Context, record: &GpuNodeHealth) -> Result<(), Error> {
    if record.owner_references().iter().all(|o| o.kind != "Node") {
        return Ok(());
    }
    let api: Api<GpuNodeHealth> = Api::all(ctx.client.clone());
    let patch = json!({"metadata": {
        "resourceVersion": record.resource_version(),
        "ownerReferences": record.owner_references().iter().filter(|o| o.kind != "Node").collect::<Vec<_>>(),
    }});
    api.patch(
        &record.name_any(),
        &PatchParams::default(),
        &Patch::Merge(patch),
    )
    .await
    .map_err(|source| Error::NodeDeleted {
        node: record.name_any(),
        source,
    })?;
    Ok(())
}

async fn gone(ctx: &Context, record: &GpuNodeHealth) -> Result<(), Error> {
    let name = record.name_any();
    // A record never given a status had nothing under way.
    let stored = &record.status.clone().unwrap_or_default();
    // The cache may lag a Node created a moment ago: gone means gone from
    // the API server.
    let failed = |source| Error::NodeDeleted {
        node: name.clone(),
        source,
    };
    if Api::<Node>::all(ctx.client.clone())
        .get_opt(&name)
        .await
        .map_err(failed)?
        .is_some()
    {
        return Ok(());
    }
    let policy = stored
        .policy
        .as_deref()
        .and_then(|p| ctx.policies.get(&ObjectRef::<GpuHealthPolicy>::new(p)));
    let spec = policy.as_ref().map_or_else(
        || GpuHealthPolicySpec::for_selector(Default::default()),
        |p| p.spec.clone(),
    );
    let rules = ctx
        .dra
        .as_ref()
        .and_then(|d| d.rules.as_ref())
        .map(|r| fences::rules_of(&r.store, &name));
    let policy_name = stored.policy.clone().unwrap_or_default();
    match node_deleted(Timestamp::now(), &policy_name, &spec, rules, stored) {
        Gone::Kept => Ok(()),
        Gone::Forget => {
            let api: Api<GpuNodeHealth> = Api::all(ctx.client.clone());
            let params = DeleteParams {
                preconditions: Some(kube::api::Preconditions {
                    resource_version: record.resource_version(),
                    uid: None,
                }),
                ..DeleteParams::default()
            };
            api.delete(&name, &params).await.map_err(failed)?;
            ctx.lock_decisions().remove(&name);
            info!(node = %name, "the node was deleted with nothing under way: its record goes with it");
            Ok(())
        }
        Gone::Record(decision) => {
            write_status(ctx, &name, &decision.status).await?;
            ctx.lock_decisions()
                .insert(name.clone(), decision.status.clone());
            if stored.phase != decision.status.phase {
                warn!(node = %name, policy = %policy_name, from = ?stored.phase, "the node was deleted mid-incident: Failed, NodeDeleted");
            }
            let view = NodeView {
                name: name.clone(),
                ..NodeView::default()
            };
            account::count(ctx, &policy_name, &view, &decision.happenings);
            // What is left to do touches nothing but gpuhealth's own fences.
            let stub = Node {
                metadata: kube::api::ObjectMeta {
                    name: Some(name.clone()),
                    ..Default::default()
                },
                ..Node::default()
            };
            for action in &decision.actions {
                actions::run(ctx, &stub, &spec, action).await?;
            }
            let about = ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(name),
                ..ObjectReference::default()
            };
            account::tell(ctx, &about, &decision.happenings).await;
            Ok(())
        }
    }
}
