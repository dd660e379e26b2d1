//! The third stage: intent first. An incident's fence carries its own
//! record of the incident (the cordon's `gpuhealth.io/cordoned-by`, a
//! `DeviceTaintRule`'s label), so it is written first, in one write as the
//! quarantine's own; then the decided status, before any other side effect.
//! An operator stopped between the two leaves the fence naming an incident
//! the status does not hold, and the engine carries that incident on
//! (`unrecorded_fence`). If nothing was written, this process's record of
//! the decision goes back to what it was (other decisions made meanwhile
//! counted an intent that did not happen, which errs on the safe side).

use std::time::{Duration, Instant};

use gpuhealth_api::{
    GpuNodeHealth, node_health::GpuNodeHealthStatus, policy::Mode, vocabulary::Reason,
};
use gpuhealth_engine::machine::{Action, Decision, is_disruptive};
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api, ResourceExt,
    api::{Patch, PatchParams},
    runtime::reflector::ObjectRef,
};
use serde_json::json;
use tracing::info;

use super::{
    decide::{Decided, Fleet},
    read::Read,
};
use crate::{
    actions,
    context::{Context, Error, MANAGER},
    failpoint::Moment,
    takeover,
};

/// How long after a takeover remediation starts are confirmed against a
/// fresh list: the previous leader's last writes reach this replica's
/// watch within seconds (seven, at worst, in the chaos runs on two loaded
/// cores); a minute leaves a wide margin.
const FRESH_BUDGET_AFTER_TAKEOVER: Duration = Duration::from_secs(60);

pub enum Recorded {
    /// The status is written (or already was): its actions may follow.
    Written(Box<Decision>),
    /// Not now: the API server shows less budget than the cache did.
    HeldBack,
}

/// Writes the decision's fences, then its status, keeping this process's
/// record of it once either lands; on any other way out, the record is
/// rolled back (`Pending`). What is left of its actions follows.
pub async fn record(
    ctx: &Context,
    node: &Node,
    read: &Read,
    decided: Decided<'_>,
) -> Result<Recorded, Error> {
    let Decided {
        mut decision,
        mut pending,
    } = decided;
    let (fences, rest): (Vec<Action>, Vec<Action>) = std::mem::take(&mut decision.actions)
        .into_iter()
        .partition(Action::fences);
    decision.actions = rest;
    let status = &decision.status;
    if let Some(term) = starts_after_takeover(ctx, read, status) {
        let listed = ctx
            .at_takeover
            .records(&ctx.client, term)
            .await
            .map_err(Error::read(&read.name))?;
        let store = takeover::merged(&ctx.node_health.state(), &listed);
        let fleet = Fleet::of(ctx, &read.policy, &read.name);
        let hold = {
            let written = ctx.lock_decisions();
            let budget = fleet.budget(ctx, &store, &written, &read.policy, &read.name);
            // Counted as the engine counted it (see `Budget::brought_forward`).
            let budget = match status.reason {
                Some(Reason::RepairedWithGang) => budget.brought_forward(),
                _ => budget,
            };
            budget.may_start().err()
        };
        if let Some(hold) = hold {
            info!(node = %read.name, policy = %read.policy_name, ?hold, "not starting: the API server shows less budget than the cache did");
            return Ok(Recorded::HeldBack);
        }
    }
    if !ctx.leadership.is_held() {
        return Err(Error::NotLeader);
    }
    if !fences.is_empty() {
        let fencing = Instant::now();
        for fence in &fences {
            actions::run(ctx, node, &read.policy.spec, fence).await?;
        }
        ctx.metrics.stage("fence", fencing);
        // The fence is the record now: the decision counts against the
        // budget whether or not its status lands.
        pending.keep();
        ctx.crash_after.at(
            Moment::AfterFencing,
            &read.name,
            read.stored.phase,
            status.phase,
        );
    }
    if !read.in_cluster.as_ref().is_some_and(|c| c.shows(status)) {
        let writing = std::time::Instant::now();
        let result = write_status(ctx, &node.name_any(), status).await;
        ctx.metrics.stage("write", writing);
        result?;
    }
    pending.keep();
    Ok(Recorded::Written(Box::new(decision)))
}

/// Starting a remediation takes from the budget, and the budget was
/// counted from this process's cache and its own records: a replica that
/// has just taken over may not yet have seen the last writes of the leader
/// before it (the chaos runs saw a third node started under maxConcurrent 2
/// right after a takeover, its view seven seconds old). Its own writes it
/// always counts, and the leader is the only writer, so only the first
/// while after a takeover is at risk: a start then is confirmed against
/// what the API server showed once this term began (`takeover`), merged
/// with the cache (one LIST of every GpuNodeHealth for every start was
/// too heavy for a large fleet: the benchmark's time to quarantine
/// quadrupled). Returns when this replica's term began, if `status`
/// starts a remediation in its first minute.
fn starts_after_takeover(
    ctx: &Context,
    read: &Read,
    status: &GpuNodeHealthStatus,
) -> Option<Instant> {
    let starts = read.policy.spec.mode == Mode::Enforce
        && !is_disruptive(read.stored.phase)
        && is_disruptive(status.phase);
    let began = ctx.leadership.term_began()?;
    (starts && began.elapsed() < FRESH_BUDGET_AFTER_TAKEOVER).then_some(began)
}

/// Writes `status` to the node's record, creating it first if need be.
pub(crate) async fn write_status(
    ctx: &Context,
    name: &str,
    status: &GpuNodeHealthStatus,
) -> Result<(), Error> {
    let failed = |source| Error::WriteStatus {
        node: name.to_owned(),
        source,
    };
    let api: Api<GpuNodeHealth> = Api::all(ctx.client.clone());
    let params = PatchParams::apply(MANAGER).force();
    if ctx.node_health.get(&ObjectRef::new(name)).is_none() {
        // One GpuNodeHealth per node, named after it. Not owned by it: an
        // incident's record outlives a Node deleted mid-incident (`gone`).
        let object = json!({
            "apiVersion": "gpuhealth.io/v1alpha1",
            "kind": "GpuNodeHealth",
            "metadata": {"name": name},
            "spec": {},
        });
        api.patch(name, &params, &Patch::Apply(object))
            .await
            .map_err(failed)?;
    }
    let patch =
        json!({"apiVersion": "gpuhealth.io/v1alpha1", "kind": "GpuNodeHealth", "status": status});
    api.patch_status(name, &params, &Patch::Apply(patch))
        .await
        .map_err(failed)?;
    Ok(())
}
