//! A policy's status: how many nodes it manages and in which phase, and its
//! `Ready`, `CircuitOpen` and `Conflict` conditions, with an Event when the
//! circuit breaker opens or closes, when what cannot be honoured of the
//! policy changes, and when it goes past the cluster's guardrails or
//! back within them.

use std::sync::Arc;

use gpuhealth_api::{
    GpuHealthPolicy,
    node_health::{GpuNodeHealthStatus, Phase, ReportProblemKind},
    policy::GpuHealthPolicyStatus,
    quarantine::GpuFence,
    vocabulary::Reason,
};
use gpuhealth_engine::{
    budget,
    honour::{self, Problem},
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::{
    Api, Resource, ResourceExt,
    api::{Patch, PatchParams},
    core::Selector,
    runtime::{controller::Action as Requeue, events::EventType},
};
use serde_json::json;
use tracing::warn;

use crate::{
    conditions,
    context::{Context, Error, MANAGER, latest},
    metrics::{FenceLabels, PhaseLabels, PolicyLabels, ReportProblemLabels},
    selection::managed,
    validation,
};

pub async fn reconcile(policy: Arc<GpuHealthPolicy>, ctx: Arc<Context>) -> Result<Requeue, Error> {
    let result = reconcile_policy(&policy, &ctx).await;
    crate::retry::settled(&ctx, "policy", &policy.name_any(), &result);
    result
}

async fn reconcile_policy(policy: &GpuHealthPolicy, ctx: &Context) -> Result<Requeue, Error> {
    if !ctx.leadership.is_held() {
        return Err(Error::NotLeader);
    }
    let name = policy.name_any();
    let (nodes, lost_to) = managed(ctx, policy);
    // Counted under the decisions lock, borrowing the statuses; no I/O here.
    let (failed, remediating, budget) = {
        let store = ctx.node_health.state();
        let written = ctx.lock_decisions();
        let of_policy: Vec<(&str, &GpuNodeHealthStatus)> = latest(&store, &written)
            .filter(|(_, s)| s.policy.as_deref() == Some(name.as_str()))
            .collect();
        let budget = budget::Fleet::count(of_policy.iter().copied()).budget(&policy.spec, nodes);
        let statuses: Vec<&GpuNodeHealthStatus> = of_policy.iter().map(|(_, s)| *s).collect();
        for phase in Phase::ALL {
            let n = statuses.iter().filter(|s| s.phase == phase).count();
            ctx.metrics
                .nodes
                .get_or_create(&PhaseLabels {
                    policy: name.clone(),
                    phase: format!("{phase:?}"),
                })
                .set(n as i64);
        }
        for problem in ReportProblemKind::ALL {
            let n = statuses
                .iter()
                .filter(|s| s.report_problem.as_ref().is_some_and(|p| p.kind == problem))
                .count();
            ctx.metrics
                .report_problems
                .get_or_create(&ReportProblemLabels {
                    policy: name.clone(),
                    problem: format!("{problem:?}"),
                })
                .set(n as i64);
        }
        for fence in [GpuFence::DeviceTaintRule, GpuFence::DevicePlugin] {
            let n: usize = statuses
                .iter()
                .filter_map(|s| s.quarantine.as_ref().filter(|q| q.per_gpu()))
                .map(|q| q.gpus.iter().filter(|g| g.fence == fence).count())
                .sum();
            ctx.metrics
                .gpus_fenced
                .get_or_create(&FenceLabels {
                    policy: name.clone(),
                    fence: format!("{fence:?}"),
                })
                .set(n as i64);
        }
        let count = |f: &dyn Fn(&GpuNodeHealthStatus) -> bool| {
            statuses.iter().filter(|s| f(s)).count() as u32
        };
        (
            count(&|s| s.phase == Phase::Failed),
            count(&|s| !matches!(s.phase, Phase::Healthy | Phase::Failed)),
            budget,
        )
    };
    ctx.metrics
        .circuit_open
        .get_or_create(&PolicyLabels {
            policy: name.clone(),
        })
        .set(i64::from(budget.circuit_open()));

    let previous = policy.status.clone().unwrap_or_default();
    let generation = policy.metadata.generation;
    let selector_error = Selector::try_from(policy.spec.node_selector.clone())
        .err()
        .map(|e| e.to_string());
    let problems = unhonoured(ctx, policy);
    ctx.metrics
        .unhonoured_fields
        .get_or_create(&PolicyLabels {
            policy: name.clone(),
        })
        .set(problems.len() as i64);
    let past_guardrails = ctx.guardrails.exceeded(&policy.spec, nodes);
    ctx.metrics
        .past_guardrails
        .get_or_create(&PolicyLabels {
            policy: name.clone(),
        })
        .set(past_guardrails.len() as i64);
    let status = GpuHealthPolicyStatus {
        observed_generation: generation,
        nodes: nodes as u32,
        healthy: (nodes as u32).saturating_sub(failed + remediating),
        remediating,
        failed,
        conditions: vec![
            conditions::ready(
                &previous.conditions,
                ctx.protection.missing(),
                &past_guardrails,
                selector_error,
                &problems,
                nodes,
                generation,
            ),
            conditions::circuit_open(&previous.conditions, &budget, generation),
            conditions::conflict(&previous.conditions, &lost_to, generation),
        ],
    };
    if policy.status.as_ref() == Some(&status) {
        return Ok(Requeue::await_change());
    }
    let api: Api<GpuHealthPolicy> = Api::all(ctx.client.clone());
    let patch =
        json!({"apiVersion": "gpuhealth.io/v1alpha1", "kind": "GpuHealthPolicy", "status": status});
    api.patch_status(
        &name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(patch),
    )
    .await
    .map_err(|source| Error::PolicyStatus {
        policy: name.clone(),
        source,
    })?;
    let was = |type_: &str| {
        previous
            .conditions
            .iter()
            .any(|c| c.type_ == type_ && c.status == "True")
    };
    let ready = &status.conditions[0];
    let circuit = &status.conditions[1];
    let conflict = &status.conditions[2];
    let mut events = Vec::new();
    // Once per change of what cannot be honoured, and once when all can.
    let now = (ready.reason == honour::REASON).then(|| ready.message.clone());
    let before = {
        let mut announced = ctx
            .honour_announced
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        announced
            .insert(name.clone(), now.clone())
            .unwrap_or_else(|| {
                // Nothing announced by this process yet: what the status said.
                previous
                    .conditions
                    .iter()
                    .find(|c| c.type_ == "Ready" && c.reason == honour::REASON)
                    .map(|c| c.message.clone())
            })
    };
    events.extend(honour_event(before.as_deref(), now, ready.status == "True"));
    let ready_before = previous.conditions.iter().find(|c| c.type_ == "Ready");
    events.extend(guardrail_event(
        ready_before,
        ready,
        past_guardrails.is_empty(),
    ));
    if was("CircuitOpen") != budget.circuit_open() {
        events.push(if budget.circuit_open() {
            (EventType::Warning, "CircuitOpen", circuit.message.clone())
        } else {
            (EventType::Normal, "CircuitClosed", circuit.message.clone())
        });
    }
    if !was("Conflict") && !lost_to.is_empty() {
        events.push((EventType::Warning, "Conflict", conflict.message.clone()));
    }
    for (type_, reason, note) in events {
        // An Event's note is at most 1 kB; the condition has it all.
        let about = policy.object_ref(&());
        if let Err(e) = ctx
            .events
            .publish(&about, type_, reason, "Status", &note)
            .await
        {
            warn!(policy = %name, error = %e, "could not publish an Event");
        }
    }
    Ok(Requeue::await_change())
}

/// The Event for a change in what cannot be honoured of a policy: `before`
/// and `now` are the `Ready` messages that said it (`None`: all could be).
fn honour_event(
    before: Option<&str>,
    now: Option<String>,
    ready: bool,
) -> Option<(EventType, &'static str, String)> {
    match now {
        Some(now) if before != Some(now.as_str()) => {
            Some((EventType::Warning, honour::REASON, now))
        }
        None if before.is_some() && ready => Some((
            EventType::Normal,
            "Honoured",
            "every field of the policy can be honoured again".into(),
        )),
        _ => None,
    }
}

/// The Event for a change of the policy's `Ready` condition past the
/// cluster's guardrails: a Warning when it goes past one, or past another;
/// a Normal one once it is `within` them again (not merely hidden behind
/// another reason, such as `Unprotected`).
fn guardrail_event(
    before: Option<&Condition>,
    now: &Condition,
    within: bool,
) -> Option<(EventType, &'static str, String)> {
    let past = Reason::PastGuardrail.as_str();
    let was = before.filter(|c| c.reason == past);
    if now.reason == past {
        return (was.map(|c| &c.message) != Some(&now.message))
            .then(|| (EventType::Warning, past, now.message.clone()));
    }
    (was.is_some() && within).then(|| {
        (
            EventType::Normal,
            "WithinGuardrails",
            "the policy is within the cluster's guardrails again".into(),
        )
    })
}

/// What in `policy` the operator cannot honour: what its spec alone shows
/// (the engine's check), a validation pod template no pod can be made
/// from, and the locks it names that cannot be read.
fn unhonoured(ctx: &Context, policy: &GpuHealthPolicy) -> Vec<Problem> {
    let spec = &policy.spec;
    let mut problems = honour::problems(spec);
    for (i, actor) in spec.other_actors.iter().enumerate() {
        if let Some(why) = ctx.locks.unreadable(actor) {
            problems.push(honour::lock_unreadable(i, actor, &why));
        }
    }
    if let Some(template) = &spec.verification.validation_pod {
        problems.extend(validation::template_problem(template, &ctx.validation));
    }
    problems
}

pub fn error_policy(policy: Arc<GpuHealthPolicy>, error: &Error, ctx: Arc<Context>) -> Requeue {
    crate::retry::retry(&policy.name_any(), "policy", error, &ctx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn going_past_a_guardrail_and_back_is_announced_once_each() {
        let ready = |reason: &str, message: &str| Condition {
            type_: "Ready".into(),
            status: if reason == "Managing" {
                "True"
            } else {
                "False"
            }
            .into(),
            reason: reason.into(),
            message: message.into(),
            last_transition_time: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ),
            observed_generation: None,
        };
        let reason = |e: Option<(EventType, &'static str, String)>| e.map(|(_, r, _)| r);
        let past = Reason::PastGuardrail.as_str();
        let managing = ready("Managing", "");
        let fleet = ready(past, "selects 3 nodes");
        let types = ready(past, "nodeConditions[0].type");
        let unprotected = ready(Reason::Unprotected.as_str(), "a binding is gone");
        assert_eq!(
            reason(guardrail_event(Some(&managing), &fleet, false)),
            Some(past)
        );
        assert_eq!(reason(guardrail_event(None, &fleet, false)), Some(past));
        assert_eq!(reason(guardrail_event(Some(&fleet), &fleet, false)), None);
        assert_eq!(
            reason(guardrail_event(Some(&fleet), &types, false)),
            Some(past),
            "past another bound"
        );
        assert_eq!(
            reason(guardrail_event(Some(&fleet), &managing, true)),
            Some("WithinGuardrails")
        );
        // Hidden behind another reason, still past: nothing said.
        assert_eq!(
            reason(guardrail_event(Some(&fleet), &unprotected, false)),
            None
        );
        assert_eq!(
            reason(guardrail_event(Some(&managing), &managing, true)),
            None
        );
    }

    #[test]
    fn what_cannot_be_honoured_is_announced_once_per_change() {
        let zone = "spec.maintenanceWindows[1].timeZone: unknown time zone";
        let lock = "spec.otherActors[1].object: cannot be read";
        let reason = |e: Option<(EventType, &'static str, String)>| e.map(|(_, r, _)| r);
        assert_eq!(
            reason(honour_event(None, Some(zone.into()), false)),
            Some("CannotHonour")
        );
        assert_eq!(
            reason(honour_event(Some(zone), Some(zone.into()), false)),
            None
        );
        assert_eq!(
            reason(honour_event(Some(zone), Some(lock.into()), false)),
            Some("CannotHonour")
        );
        assert_eq!(
            reason(honour_event(Some(lock), None, true)),
            Some("Honoured")
        );
        assert_eq!(reason(honour_event(None, None, true)), None);
        // Ready False for its selector: nothing to say of honouring.
        assert_eq!(reason(honour_event(Some(lock), None, false)), None);
    }
}
