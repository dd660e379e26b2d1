//! One node's reconcile, as a pipeline:
//!
//! 1. [`read`]: the node, its policy, its stored status, and what the engine
//!    says its step needs (pods, budgets, workloads, the validation pod);
//! 2. [`decide`]: the budget and the engine's step, under the decisions lock;
//! 3. [`record`]: the decided status written before any side effect, with
//!    this process's in-memory record rolled back if it is not;
//! 4. [`act`]: the actions, in order, while this replica leads;
//! 5. account: the step's happenings as metrics and Events (`crate::account`).

mod act;
mod decide;
mod last_look;
mod pending;
mod read;
mod record;

use std::{sync::Arc, time::Duration};

use k8s_openapi::api::core::v1::Node;
use kube::{Resource, ResourceExt, runtime::controller::Action as Requeue};

pub(crate) use self::record::write_status;
use crate::{
    account,
    context::{Context, Error},
    error::Subject,
    retry,
};

pub async fn reconcile(node: Arc<Node>, ctx: Arc<Context>) -> Result<Requeue, Error> {
    let _running = ctx.in_flight.start();
    let started = std::time::Instant::now();
    let result = reconcile_node(&node, &ctx).await;
    ctx.metrics
        .reconcile_duration
        .observe(started.elapsed().as_secs_f64());
    retry::settled(&ctx, Subject::Node, &node.name_any(), &result);
    result
}

pub fn error_policy(node: Arc<Node>, error: &Error, ctx: Arc<Context>) -> Requeue {
    retry::retry(&node.name_any(), Subject::Node, error, &ctx)
}

async fn reconcile_node(node: &Node, ctx: &Context) -> Result<Requeue, Error> {
    if !ctx.leadership.is_held() {
        return Err(Error::NotLeader);
    }
    let started = std::time::Instant::now();
    let Some(read) = read::read(ctx, node).await? else {
        // No policy manages the node.
        return Ok(Requeue::await_change());
    };
    let waiting = ctx.metrics.stage("read", started);
    let decided = decide::decide(ctx, &read, waiting);
    let decision = match record::record(ctx, node, &read, decided).await? {
        record::Recorded::Written(decision) => decision,
        record::Recorded::HeldBack => return Ok(Requeue::requeue(Duration::from_secs(2))),
    };
    account::count(ctx, &read.policy_name, &read.view, &decision.happenings);
    act::act(ctx, node, &read, &decision).await?;
    account::tell(ctx, &node.object_ref(&()), &decision.happenings).await;
    read.remember_holders(ctx);
    if read.needs.gates_later {
        return Ok(Requeue::requeue(Duration::from_secs(1)));
    }
    Ok(match decision.requeue_after {
        Some(after) => Requeue::requeue(after.max(Duration::from_secs(1))),
        None => Requeue::requeue(Duration::from_secs(300)),
    })
}

#[cfg(test)]
mod tests;
