//! The fourth stage: the recorded decision's actions, in order (a gang's
//! members together), each carried out only while this replica still leads.

use gpuhealth_api::vocabulary::Reason;
use gpuhealth_engine::machine::{Action, Decision};
use k8s_openapi::api::core::v1::Node;
use tracing::{debug, info, warn};

use super::{last_look, read::Read};
use crate::{
    actions,
    context::{Context, Error},
    failpoint::Moment,
};

pub async fn act(
    ctx: &Context,
    node: &Node,
    read: &Read,
    decision: &Decision,
) -> Result<(), Error> {
    let (from, to) = (read.stored.phase, decision.status.phase);
    ctx.crash_after
        .at(Moment::BeforeActing, &read.name, from, to);
    log_transition(read, decision);
    let acting = std::time::Instant::now();
    let mut actions = decision.actions.iter().peekable();
    while let Some(action) = actions.next() {
        if !ctx.leadership.is_held() {
            return Err(Error::NotLeader);
        }
        if is_gangs(action) {
            // A gang's members are told, and deleted, as near together as
            // the API server allows: one at a time, the last rank of a
            // thousand would go half a minute after the first.
            let mut batch = vec![action];
            while let Some(next) = actions.next_if(|a| is_gangs(a)) {
                batch.push(next);
            }
            debug!(node = %read.name, members = batch.len(), "carrying out for a gang");
            let spec = &read.policy.spec;
            for chunk in batch.chunks(GANG_WRITES_AT_ONCE) {
                let mut writes = Vec::with_capacity(chunk.len());
                for a in chunk {
                    writes.push(actions::run(ctx, node, spec, a));
                }
                futures::future::try_join_all(writes).await?;
            }
            continue;
        }
        let unseen = last_look::unseen_holder(ctx, read, action).await;
        if let Some(pod) = unseen.map_err(Error::read(&read.name))? {
            // The record says the request is in flight; the next step
            // finds it missing, drains the pod, and only then asks again.
            warn!(node = %read.name, %pod, ?action, "not asked for yet: a pod the step had not seen holds a GPU it covers");
            continue;
        }
        debug!(node = %read.name, ?action, "carrying out");
        actions::run(ctx, node, &read.policy.spec, action).await?;
    }
    if !decision.actions.is_empty() {
        ctx.metrics.stage("act", acting);
    }
    ctx.crash_after
        .at(Moment::AfterActing, &read.name, from, to);
    Ok(())
}

/// How many of a gang's members are written to at once.
const GANG_WRITES_AT_ONCE: usize = 16;

fn is_gangs(action: &Action) -> bool {
    matches!(
        action,
        Action::TellGangMember { .. } | Action::EvictGangMember { .. }
    )
}

/// One line per transition, with what an SRE greps for.
fn log_transition(read: &Read, decision: &Decision) {
    let (before, st) = (&read.stored, &decision.status);
    if before.phase != st.phase || before.reason != st.reason {
        info!(
            node = %read.name,
            policy = %read.policy_name,
            from = ?before.phase,
            phase = ?st.phase,
            reason = st.reason.map_or("", Reason::as_str),
            action = st.action.as_ref().map(|a| format!("{:?}#{}", a.type_, a.attempt)).unwrap_or_default(),
            incident = st.incident.as_deref().or(st.history.first().map(|i| i.id.as_str())).unwrap_or(""),
            // Not `message`: that is the event's own text in JSON logs.
            detail = st.message.as_deref().unwrap_or(""),
            "transition"
        );
    }
    debug!(
        node = %read.name,
        phase = ?st.phase,
        reason = st.reason.map_or("", Reason::as_str),
        requeue = ?decision.requeue_after,
        "decided"
    );
}
