//! The last stage of a node's reconcile: what the engine's decision did and
//! noticed (its happenings), counted in the metrics and told in Events.
//! Nothing here reads a status back: each happening says what it is.

use std::borrow::Cow;

use gpuhealth_api::{
    gang::{DISRUPTION_PENDING_CONDITION, EVICT_AT_ANNOTATION},
    node_health::Phase,
    vocabulary::{FindingKind, IncidentOutcome, PodKey, Reason},
};
use gpuhealth_engine::{happening::Happening, machine::NodeView};
use k8s_openapi::{api::core::v1::ObjectReference, jiff::Timestamp};
use kube::runtime::events::EventType;

use crate::{
    actions::publish,
    context::Context,
    metrics::{FindingLabels, OutcomeLabels, PolicyLabels, RemediationLabels, ReportLabels},
};

/// Counts what the decision did, once its record is written (before its
/// actions, so that a time measured to the cordon ends at the decision).
pub fn count(ctx: &Context, policy: &str, view: &NodeView, happenings: &[Happening]) {
    let m = &ctx.metrics;
    for happening in happenings {
        match happening {
            Happening::Found { kind, .. } => {
                m.findings
                    .get_or_create(&FindingLabels {
                        policy: policy.into(),
                        finding: kind.as_str().into(),
                    })
                    .inc();
                // Which way the report is malformed is the operator's to
                // say: the engine only saw that it was.
                if *kind == FindingKind::MalformedGpuReport
                    && let Some(Err(e)) = &view.report
                {
                    m.malformed_reports
                        .get_or_create(&ReportLabels {
                            policy: policy.into(),
                            error: e.metric_label().into(),
                        })
                        .inc();
                }
            }
            Happening::Attempted(attempt) if attempt.is_remediation() => {
                m.remediations
                    .get_or_create(&RemediationLabels {
                        policy: policy.into(),
                        action: attempt.action.as_str().into(),
                        outcome: attempt.outcome.as_str().into(),
                    })
                    .inc();
            }
            Happening::Closed {
                outcome, lasted, ..
            } => {
                m.incidents
                    .get_or_create(&OutcomeLabels {
                        policy: policy.into(),
                        outcome: outcome.as_str().into(),
                    })
                    .inc();
                if *outcome == IncidentOutcome::Recovered {
                    m.time_to_recovery.observe(lasted.as_secs_f64());
                }
            }
            Happening::QuarantinedForReport { observed_at } => {
                let since = Timestamp::now().duration_since(*observed_at);
                m.time_to_quarantine.observe(since.as_secs_f64().max(0.0));
            }
            Happening::GpuFenceEnded {
                serving, lasted, ..
            } => {
                m.gpu_seconds_kept
                    .get_or_create(&PolicyLabels {
                        policy: policy.into(),
                    })
                    .inc_by(f64::from(*serving) * lasted.as_secs_f64());
            }
            _ => {}
        }
    }
}

/// Tells the happenings that a person should see as Events on the node (or
/// the pod concerned), after the decision's actions: an Event informs and
/// must never delay one. Best effort, each counted as the action `event`.
pub async fn tell(ctx: &Context, node: &ObjectReference, happenings: &[Happening]) {
    for happening in happenings {
        let Some(event) = event_of(happening) else {
            continue;
        };
        let about = match event.pod {
            Some(key) => pod_ref(key),
            None => node.clone(),
        };
        let told = publish(
            ctx,
            &about,
            event.type_,
            event.reason,
            event.message.into_owned(),
        )
        .await;
        ctx.metrics
            .action("event", if told { "done" } else { "failed" });
    }
}

struct Told<'a> {
    type_: EventType,
    reason: &'a str,
    message: Cow<'a, str>,
    pod: Option<&'a PodKey>,
}

fn event_of<'a>(happening: &'a Happening) -> Option<Told<'a>> {
    let told = |type_, reason, message: &'a str| Told {
        type_,
        reason,
        message: message.into(),
        pod: None,
    };
    Some(match happening {
        Happening::Entered {
            phase,
            reason,
            message,
        } => {
            let warning = *phase == Phase::Failed || *reason == Reason::CircuitOpen;
            let type_ = if warning {
                EventType::Warning
            } else {
                EventType::Normal
            };
            told(type_, reason.as_str(), message)
        }
        Happening::Found { kind, message, pod } => Told {
            type_: EventType::Warning,
            reason: kind.as_str(),
            message: message.into(),
            pod: pod.as_ref(),
        },
        Happening::GangTold { gang, members, at } => Told {
            type_: EventType::Normal,
            reason: "GangTold",
            message: format!(
                "{gang}: its {members} members are told (annotation {EVICT_AT_ANNOTATION}, condition {DISRUPTION_PENDING_CONDITION}) that they are evicted together at {at}"
            )
            .into(),
            pod: None,
        },
        Happening::GangEvicted {
            gang,
            members,
            nodes,
        } => Told {
            type_: EventType::Normal,
            reason: "GangEvicted",
            message: format!(
                "{gang}: its {members} members on {nodes} nodes deleted together, each with the DisruptionTarget condition"
            )
            .into(),
            pod: None,
        },
        Happening::AttemptFailed { why } => told(EventType::Warning, "AttemptFailed", why),
        Happening::Closed {
            outcome: outcome @ IncidentOutcome::Recovered,
            message,
            ..
        } => told(EventType::Normal, outcome.as_str(), message),
        Happening::Closed {
            outcome: IncidentOutcome::Cancelled,
            message,
            ..
        } => told(EventType::Normal, "MaintenanceCancelled", message),
        Happening::WorkloadsRecovered { message } => {
            told(EventType::Normal, "WorkloadsRecovered", message)
        }
        // Failed is told by entering the phase; the rest are counted only.
        Happening::Closed {
            outcome: IncidentOutcome::Failed,
            ..
        }
        | Happening::Attempted(_)
        | Happening::QuarantinedForReport { .. }
        | Happening::GpuFenceEnded { .. } => return None,
    })
}

fn pod_ref(key: &PodKey) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        namespace: Some(key.namespace.clone()),
        name: Some(key.name.clone()),
        ..Default::default()
    }
}
