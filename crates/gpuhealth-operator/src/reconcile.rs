//! One node's reconcile: read the world, let the engine decide, record the
//! decision, then carry it out.

use std::{collections::HashMap, sync::Arc, time::Duration};

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
    runtime::{
        controller::Action as Requeue,
        events::{Event, EventType},
        reflector::ObjectRef,
    },
};
use serde_json::json;
use tracing::{debug, warn};

use crate::{
    actions, conditions,
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
    let view = node_view(&node);
    if let Some(Err(e)) = &view.report {
        warn!(node = %name, error = %e, "malformed GPU report; ignoring it");
    }

    // Held until the status is written. `written` holds what this process
    // wrote last, which the watch-fed store may not show yet.
    let mut written = ctx.decisions.lock().await;
    let in_cluster = ctx
        .node_health
        .get(&ObjectRef::new(&name))
        .and_then(|g| g.status.clone());
    let stored = written
        .get(&name)
        .cloned()
        .or(in_cluster.clone())
        .unwrap_or_default();
    let budget = budget(&ctx, &written, &policy, &name);
    // Pods are listed only for a node that may need draining, so memory
    // follows the work in flight rather than the size of the cluster.
    let has_bad_gpu = matches!(&view.report, Some(Ok(r)) if r.bad_gpus().next().is_some());
    let pods = if stored.phase != Phase::Healthy || has_bad_gpu {
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
    if in_cluster.as_ref() != Some(&decision.status) {
        write_status(&ctx, &node, &decision.status).await?;
    }
    written.insert(name.clone(), decision.status.clone());
    let latest = latest(&ctx, &written);
    drop(written);

    debug!(
        node = %name,
        phase = ?decision.status.phase,
        reason = decision.status.reason.as_deref().unwrap_or(""),
        requeue = ?decision.requeue_after,
        "decided"
    );
    for action in &decision.actions {
        debug!(node = %name, ?action, "carrying out");
        actions::run(&ctx, &node, action).await?;
    }
    update_policy_status(&ctx, &policy, &latest).await?;
    Ok(match decision.requeue_after {
        Some(after) => Requeue::requeue(after.max(Duration::from_secs(1))),
        None => Requeue::requeue(Duration::from_secs(300)),
    })
}

/// The latest status of every node: what this process wrote last, else
/// what the watch shows.
fn latest(
    ctx: &Context,
    written: &HashMap<String, GpuNodeHealthStatus>,
) -> HashMap<String, GpuNodeHealthStatus> {
    let mut all: HashMap<String, GpuNodeHealthStatus> = ctx
        .node_health
        .state()
        .iter()
        .filter_map(|g| Some((g.name_any(), g.status.clone()?)))
        .collect();
    all.extend(written.iter().map(|(k, v)| (k.clone(), v.clone())));
    all
}

fn budget(
    ctx: &Context,
    written: &HashMap<String, GpuNodeHealthStatus>,
    policy: &GpuHealthPolicy,
    this: &str,
) -> Budget {
    let policy_name = policy.name_any();
    let nodes = selected_nodes(ctx, policy);
    let others: Vec<GpuNodeHealthStatus> = latest(ctx, written)
        .into_iter()
        .filter(|(name, s)| name != this && s.policy.as_deref() == Some(policy_name.as_str()))
        .map(|(_, s)| s)
        .collect();
    let disruptive = others.iter().filter(|s| is_disruptive(s.phase)).count();
    let unhealthy = others.iter().filter(|s| unhealthy(s)).count();
    // This node counts itself only when it wants to start, which is the only
    // time the engine consults the breaker.
    Budget::new(&policy.spec, nodes, disruptive, unhealthy + 1)
}

/// How many nodes `policy` selects now.
fn selected_nodes(ctx: &Context, policy: &GpuHealthPolicy) -> usize {
    ctx.nodes
        .state()
        .iter()
        .filter(|n| selects(policy, n))
        .count()
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

/// The policy's counts and its circuit-breaker condition, from the latest
/// status of the nodes it manages.
async fn update_policy_status(
    ctx: &Context,
    policy: &GpuHealthPolicy,
    latest: &HashMap<String, GpuNodeHealthStatus>,
) -> Result<(), Error> {
    let policy_name = policy.name_any();
    let statuses: Vec<&GpuNodeHealthStatus> = latest
        .values()
        .filter(|s| s.policy.as_deref() == Some(policy_name.as_str()))
        .collect();
    let nodes = selected_nodes(ctx, policy);
    let count =
        |f: &dyn Fn(&GpuNodeHealthStatus) -> bool| statuses.iter().filter(|s| f(s)).count() as u32;
    let failed = count(&|s| s.phase == Phase::Failed);
    let remediating = count(&|s| !matches!(s.phase, Phase::Healthy | Phase::Failed));
    let sick = count(&unhealthy) as usize;
    let budget = Budget::new(&policy.spec, nodes, 0, sick);
    let previous = policy.status.clone().unwrap_or_default();
    let circuit =
        conditions::circuit_open(&previous.conditions, &budget, policy.metadata.generation);
    let status = GpuHealthPolicyStatus {
        observed_generation: policy.metadata.generation,
        nodes: nodes as u32,
        healthy: (nodes as u32).saturating_sub(failed + remediating),
        remediating,
        failed,
        conditions: vec![circuit],
    };
    if policy.status.as_ref() == Some(&status) {
        return Ok(());
    }
    let was_open = previous
        .conditions
        .iter()
        .any(|c| c.type_ == "CircuitOpen" && c.status == "True");
    let is_open = budget.circuit_open();
    let api: Api<GpuHealthPolicy> = Api::all(ctx.client.clone());
    let patch =
        json!({"apiVersion": "gpuhealth.io/v1alpha1", "kind": "GpuHealthPolicy", "status": status});
    api.patch_status(
        &policy_name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(patch),
    )
    .await?;
    if was_open != is_open {
        let (type_, reason) = if is_open {
            (EventType::Warning, "CircuitOpen")
        } else {
            (EventType::Normal, "CircuitClosed")
        };
        let message = status
            .conditions
            .first()
            .map(|c| c.message.clone())
            .unwrap_or_default();
        let event = Event {
            type_,
            reason: reason.into(),
            note: Some(message),
            action: "Budget".into(),
            secondary: None,
        };
        if let Err(e) = ctx.recorder.publish(&event, &policy.object_ref(&())).await {
            warn!(policy = %policy_name, error = %e, "could not publish an Event");
        }
    }
    Ok(())
}

pub fn error_policy(node: Arc<Node>, error: &Error, _ctx: Arc<Context>) -> Requeue {
    warn!(node = %node.name_any(), error = %error, kind = error.metric_label(), "reconcile failed; retrying");
    Requeue::requeue(Duration::from_secs(5))
}
