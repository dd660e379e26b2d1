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
    vocabulary::{PolicyCondition, Reason},
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
    error::Subject,
    metrics::{FenceLabels, PhaseLabels, PolicyLabels, ReportProblemLabels},
    retry,
    selection::managed,
    validation,
};

pub async fn reconcile(policy: Arc<GpuHealthPolicy>, ctx: Arc<Context>) -> Result<Requeue, Error> {
    let result = reconcile_policy(&policy, &ctx).await;
    retry::settled(&ctx, Subject::Policy, &policy.name_any(), &result);
    result
}

/// A policy's reconcile, through the stages of a node's: count (read its
/// nodes' statuses, under the decisions lock, no I/O), decide its status,
/// record it, and tell what changed in Events.
async fn reconcile_policy(policy: &GpuHealthPolicy, ctx: &Context) -> Result<Requeue, Error> {
    if !ctx.leadership.is_held() {
        return Err(Error::NotLeader);
    }
    let name = policy.name_any();
    let previous = policy.status.clone().unwrap_or_default();
    let counted = count(ctx, policy, &name);
    let decided = decide(ctx, policy, &previous, &counted);
    if policy.status.as_ref() == Some(&decided.status) {
        return Ok(Requeue::await_change());
    }
    record(ctx, &name, &decided.status).await?;
    tell(ctx, policy, &previous, &counted, &decided).await;
    Ok(Requeue::await_change())
}

/// What a policy's nodes are: how many it manages, which policies took the
/// others it selects, how many failed or are under way, and its budget.
struct Counted {
    nodes: usize,
    lost_to: Vec<(String, usize)>,
    failed: u32,
    remediating: u32,
    budget: budget::Budget,
}

/// Counts the policy's nodes under the decisions lock, borrowing the
/// statuses (no I/O), and sets the policy's gauges.
fn count(ctx: &Context, policy: &GpuHealthPolicy, name: &str) -> Counted {
    let (nodes, lost_to) = managed(ctx, policy);
    let store = ctx.node_health.state();
    let written = ctx.lock_decisions();
    let of_policy: Vec<(&str, &GpuNodeHealthStatus)> = latest(&store, &written)
        .filter(|(_, s)| s.policy.as_deref() == Some(name))
        .collect();
    let budget = budget::Fleet::count(of_policy.iter().copied()).budget(&policy.spec, nodes);
    let statuses: Vec<&GpuNodeHealthStatus> = of_policy.iter().map(|(_, s)| *s).collect();
    gauges(ctx, name, &statuses, &budget);
    let count =
        |f: &dyn Fn(&GpuNodeHealthStatus) -> bool| statuses.iter().filter(|s| f(s)).count() as u32;
    Counted {
        nodes,
        lost_to,
        failed: count(&|s| s.phase == Phase::Failed),
        remediating: count(&|s| !matches!(s.phase, Phase::Healthy | Phase::Failed)),
        budget,
    }
}

/// The policy's gauges: its nodes by phase, report problems, nodes not
/// reporting and fenced GPUs, and whether its circuit is open.
fn gauges(ctx: &Context, name: &str, statuses: &[&GpuNodeHealthStatus], budget: &budget::Budget) {
    let m = &ctx.metrics;
    for phase in Phase::ALL {
        let n = statuses.iter().filter(|s| s.phase == phase).count();
        m.nodes
            .get_or_create(&PhaseLabels {
                policy: name.to_owned(),
                phase: format!("{phase:?}"),
            })
            .set(n as i64);
    }
    for problem in ReportProblemKind::ALL {
        let n = statuses
            .iter()
            .filter(|s| s.report_problem.as_ref().is_some_and(|p| p.kind == problem))
            .count() as i64;
        let policy = name.to_owned();
        // A node with no report is a gauge of its own: there is no report
        // to have a problem, and its alert's causes are the agent's install.
        if problem == ReportProblemKind::Missing {
            m.nodes_not_reporting
                .get_or_create(&PolicyLabels { policy })
                .set(n);
            continue;
        }
        m.report_problems
            .get_or_create(&ReportProblemLabels {
                policy,
                problem: format!("{problem:?}"),
            })
            .set(n);
    }
    for fence in [GpuFence::DeviceTaintRule, GpuFence::DevicePlugin] {
        let n: usize = statuses
            .iter()
            .filter_map(|s| s.quarantine.as_ref().filter(|q| q.per_gpu()))
            .map(|q| q.gpus.iter().filter(|g| g.fence == fence).count())
            .sum();
        m.gpus_fenced
            .get_or_create(&FenceLabels {
                policy: name.to_owned(),
                fence: format!("{fence:?}"),
            })
            .set(n as i64);
    }
    let policy = PolicyLabels {
        policy: name.to_owned(),
    };
    m.circuit_open
        .get_or_create(&policy)
        .set(i64::from(budget.circuit_open()));
}

/// The policy's decided status, and whether it is within the cluster's
/// guardrails.
struct Decided {
    status: GpuHealthPolicyStatus,
    within_guardrails: bool,
}

fn decide(
    ctx: &Context,
    policy: &GpuHealthPolicy,
    previous: &GpuHealthPolicyStatus,
    counted: &Counted,
) -> Decided {
    let generation = policy.metadata.generation;
    let selector_error = Selector::try_from(policy.spec.node_selector.clone())
        .err()
        .map(|e| e.to_string());
    let problems = unhonoured(ctx, policy);
    let past_guardrails = ctx.guardrails.exceeded(&policy.spec, counted.nodes);
    let labels = PolicyLabels {
        policy: policy.name_any(),
    };
    ctx.metrics
        .unhonoured_fields
        .get_or_create(&labels)
        .set(problems.len() as i64);
    ctx.metrics
        .past_guardrails
        .get_or_create(&labels)
        .set(past_guardrails.len() as i64);
    let nodes = counted.nodes as u32;
    let status = GpuHealthPolicyStatus {
        observed_generation: generation,
        nodes,
        healthy: nodes.saturating_sub(counted.failed + counted.remediating),
        remediating: counted.remediating,
        failed: counted.failed,
        conditions: vec![
            conditions::ready(
                &previous.conditions,
                ctx.protection.missing(),
                &past_guardrails,
                selector_error,
                &problems,
                counted.nodes,
                generation,
            ),
            conditions::circuit_open(&previous.conditions, &counted.budget, generation),
            conditions::conflict(&previous.conditions, &counted.lost_to, generation),
        ],
    };
    Decided {
        status,
        within_guardrails: past_guardrails.is_empty(),
    }
}

async fn record(ctx: &Context, name: &str, status: &GpuHealthPolicyStatus) -> Result<(), Error> {
    let api: Api<GpuHealthPolicy> = Api::all(ctx.client.clone());
    let patch =
        json!({"apiVersion": "gpuhealth.io/v1alpha1", "kind": "GpuHealthPolicy", "status": status});
    api.patch_status(
        name,
        &PatchParams::apply(MANAGER).force(),
        &Patch::Apply(patch),
    )
    .await
    .map_err(|source| Error::PolicyStatus {
        policy: name.to_owned(),
        source,
    })?;
    Ok(())
}

/// Events for what changed between the stored status and the one written:
/// what cannot be honoured, the guardrails, the breaker, a conflict.
async fn tell(
    ctx: &Context,
    policy: &GpuHealthPolicy,
    previous: &GpuHealthPolicyStatus,
    counted: &Counted,
    decided: &Decided,
) {
    let name = policy.name_any();
    let status = &decided.status;
    let (Some(ready), Some(circuit), Some(conflict)) = (
        status.condition(PolicyCondition::Ready),
        status.condition(PolicyCondition::CircuitOpen),
        status.condition(PolicyCondition::Conflict),
    ) else {
        return;
    };
    let mut events = Vec::new();
    // Once per change of what cannot be honoured, and once when all can.
    let now = (ready.reason == honour::REASON).then(|| ready.message.clone());
    let before = {
        let mut announced = ctx.honour_announced.lock();
        announced
            .insert(name.to_owned(), now.clone())
            .unwrap_or_else(|| {
                // Nothing announced by this process yet: what the status said.
                previous
                    .condition(PolicyCondition::Ready)
                    .filter(|c| c.reason == honour::REASON)
                    .map(|c| c.message.clone())
            })
    };
    events.extend(honour_event(before.as_deref(), now, ready.status == "True"));
    events.extend(guardrail_event(
        previous.condition(PolicyCondition::Ready),
        ready,
        decided.within_guardrails,
    ));
    let open = counted.budget.circuit_open();
    if previous.is_true(PolicyCondition::CircuitOpen) != open {
        events.push(if open {
            (EventType::Warning, "CircuitOpen", circuit.message.clone())
        } else {
            (EventType::Normal, "CircuitClosed", circuit.message.clone())
        });
    }
    if !previous.is_true(PolicyCondition::Conflict) && !counted.lost_to.is_empty() {
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
    retry::retry(&policy.name_any(), Subject::Policy, error, &ctx)
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

    #[tokio::test]
    async fn a_node_with_no_report_is_counted_apart_from_report_problems() {
        let w = crate::testing::World::new(std::time::Duration::from_secs(600));
        let status = |kind: Option<ReportProblemKind>| GpuNodeHealthStatus {
            report_problem: kind.map(|kind| gpuhealth_api::node_health::ReportProblem {
                kind,
                message: String::new(),
            }),
            ..Default::default()
        };
        let (missing, also_missing, stale, fine) = (
            status(Some(ReportProblemKind::Missing)),
            status(Some(ReportProblemKind::Missing)),
            status(Some(ReportProblemKind::Stale)),
            status(None),
        );
        let spec = gpuhealth_api::GpuHealthPolicySpec::for_selector(Default::default());
        let budget = budget::Budget::new(&spec, 4, 0, 0);
        gauges(
            &w.ctx,
            "fleet",
            &[&missing, &also_missing, &stale, &fine],
            &budget,
        );
        let m = &w.ctx.metrics;
        let policy = PolicyLabels {
            policy: "fleet".into(),
        };
        assert_eq!(m.nodes_not_reporting.get_or_create(&policy).get(), 2);
        let problems = |problem: &str| {
            m.report_problems
                .get_or_create(&ReportProblemLabels {
                    policy: "fleet".into(),
                    problem: problem.into(),
                })
                .get()
        };
        assert_eq!((problems("Stale"), problems("Unreadable")), (1, 0));
        // Reported again: the gauge drops.
        gauges(&w.ctx, "fleet", &[&fine, &stale], &budget);
        assert_eq!(m.nodes_not_reporting.get_or_create(&policy).get(), 0);
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
