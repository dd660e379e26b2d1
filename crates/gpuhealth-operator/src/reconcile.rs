//! One node's reconcile: read the world, let the engine decide, record the
//! decision, then carry it out.

use std::{sync::Arc, time::Duration};

use gpuhealth_api::{
    GpuHealthPolicy, GpuNodeHealth,
    node_health::{GpuNodeHealthStatus, Phase},
    policy::GpuHealthPolicyStatus,
};
use gpuhealth_engine::{
    budget::Budget,
    machine::{Input, is_disruptive, step},
};
use k8s_openapi::{
    api::core::v1::{Node, Pod},
    jiff::Timestamp,
};
use kube::{
    Api, Resource, ResourceExt,
    api::{ListParams, Patch, PatchParams},
    runtime::{controller::Action as Requeue, reflector::ObjectRef},
};
use serde_json::json;
use tracing::{debug, warn};

use crate::{
    actions,
    context::{Context, Error, MANAGER},
    observe::{gpu_holders, node_view, pod_view},
    selection::{selects, winner},
};

pub async fn reconcile(node: Arc<Node>, ctx: Arc<Context>) -> Result<Requeue, Error> {
    let policies = ctx.policies.state();
    let Some(policy) = winner(&policies, &node) else {
        return Ok(Requeue::await_change());
    };
    let name = node.name_any();
    let policy_name = policy.name_any();
    let stored = ctx
        .node_health
        .get(&ObjectRef::new(&name))
        .and_then(|g| g.status.clone())
        .unwrap_or_default();
    let view = node_view(&node);
    if let Some(Err(e)) = &view.report {
        warn!(node = %name, error = %e, "malformed GPU report; ignoring it");
    }

    let budget = budget(&ctx, &policy, &name);
    // Pods are listed only for a node that may need draining, so memory
    // follows the work in flight rather than the size of the cluster.
    let may_drain = stored.phase != Phase::Healthy
        || view
            .report
            .as_ref()
            .is_some_and(|r| r.as_ref().is_ok_and(|r| r.bad_gpus().next().is_some()));
    let pods = if may_drain {
        let holders = gpu_holders(&view);
        let api: Api<Pod> = Api::all(ctx.client.clone());
        let list = api
            .list(&ListParams::default().fields(&format!("spec.nodeName={name}")))
            .await?;
        list.items.iter().map(|p| pod_view(p, &holders)).collect()
    } else {
        Vec::new()
    };

    let decision = step(&Input {
        now: Timestamp::now(),
        policy: &policy_name,
        spec: &policy.spec,
        node: &view,
        pods: &pods,
        budget,
        state: &stored,
    });

    // Intent first: the status is written before any side effect.
    if decision.status != stored || ctx.node_health.get(&ObjectRef::new(&name)).is_none() {
        write_status(&ctx, &node, &decision.status).await?;
    }
    for action in &decision.actions {
        debug!(node = %name, ?action, "carrying out");
        actions::run(&ctx, &node, action).await?;
    }
    update_policy_status(&ctx, &policy, &name, &decision.status).await?;
    Ok(match decision.requeue_after {
        Some(after) => Requeue::requeue(after.max(Duration::from_secs(1))),
        None => Requeue::requeue(Duration::from_secs(300)),
    })
}

fn budget(ctx: &Context, policy: &GpuHealthPolicy, this: &str) -> Budget {
    let policy_name = policy.name_any();
    let nodes = ctx
        .nodes
        .state()
        .iter()
        .filter(|n| selects(policy, n))
        .count();
    let others: Vec<GpuNodeHealthStatus> = ctx
        .node_health
        .state()
        .iter()
        .filter(|g| g.name_any() != this)
        .filter_map(|g| g.status.clone())
        .filter(|s| s.policy.as_deref() == Some(policy_name.as_str()))
        .collect();
    let disruptive = others.iter().filter(|s| is_disruptive(s.phase)).count();
    let unhealthy = others.iter().filter(|s| unhealthy(s)).count();
    // This node counts itself only when it wants to start, which is the only
    // time the engine consults the breaker.
    Budget::new(&policy.spec, nodes, disruptive, unhealthy + 1)
}

fn unhealthy(s: &GpuNodeHealthStatus) -> bool {
    s.phase != Phase::Healthy && s.reason.as_deref() != Some("SignalPending")
}

async fn write_status(
    ctx: &Context,
    node: &Node,
    status: &GpuNodeHealthStatus,
) -> Result<(), Error> {
    let api: Api<GpuNodeHealth> = Api::all(ctx.client.clone());
    let name = node.name_any();
    let params = PatchParams::apply(MANAGER).force();
    if ctx.node_health.get(&ObjectRef::new(&name)).is_none() {
        // One GpuNodeHealth per node, named after it and owned by it, so it
        // goes when the node goes.
        let owner = node.controller_owner_ref(&()).map(|mut o| {
            o.controller = Some(false);
            o
        });
        let object = json!({
            "apiVersion": "gpuhealth.io/v1alpha1",
            "kind": "GpuNodeHealth",
            "metadata": {"name": name, "ownerReferences": owner.into_iter().collect::<Vec<_>>()},
            "spec": {},
        });
        api.patch(&name, &params, &Patch::Apply(object)).await?;
    }
    let patch =
        json!({"apiVersion": "gpuhealth.io/v1alpha1", "kind": "GpuNodeHealth", "status": status});
    api.patch_status(&name, &params, &Patch::Apply(patch))
        .await?;
    Ok(())
}

/// The policy's counts, from the node-health objects it manages.
async fn update_policy_status(
    ctx: &Context,
    policy: &GpuHealthPolicy,
    this: &str,
    this_status: &GpuNodeHealthStatus,
) -> Result<(), Error> {
    let policy_name = policy.name_any();
    let mut statuses: Vec<GpuNodeHealthStatus> = ctx
        .node_health
        .state()
        .iter()
        .filter(|g| g.name_any() != this)
        .filter_map(|g| g.status.clone())
        .filter(|s| s.policy.as_deref() == Some(policy_name.as_str()))
        .collect();
    statuses.push(this_status.clone());
    let nodes = ctx
        .nodes
        .state()
        .iter()
        .filter(|n| selects(policy, n))
        .count() as u32;
    let count =
        |f: &dyn Fn(&GpuNodeHealthStatus) -> bool| statuses.iter().filter(|s| f(s)).count() as u32;
    let failed = count(&|s| s.phase == Phase::Failed);
    let remediating = count(&|s| !matches!(s.phase, Phase::Healthy | Phase::Failed));
    let status = GpuHealthPolicyStatus {
        observed_generation: policy.metadata.generation,
        nodes,
        healthy: nodes.saturating_sub(failed + remediating),
        remediating,
        failed,
        conditions: policy
            .status
            .as_ref()
            .map(|s| s.conditions.clone())
            .unwrap_or_default(),
    };
    if policy.status.as_ref() == Some(&status) {
        return Ok(());
    }
    let api: Api<GpuHealthPolicy> = Api::all(ctx.client.clone());
    let patch =
        json!({"apiVersion": "gpuhealth.io/v1alpha1", "kind": "GpuHealthPolicy", "status": status});
    api.patch_status(
        &policy_name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(patch),
    )
    .await?;
    Ok(())
}

pub fn error_policy(node: Arc<Node>, error: &Error, _ctx: Arc<Context>) -> Requeue {
    warn!(node = %node.name_any(), error = %error, kind = error.metric_label(), "reconcile failed; retrying");
    Requeue::requeue(Duration::from_secs(5))
}
