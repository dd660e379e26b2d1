//! Whether a request on the Node is the operator's: the one the node's
//! `GpuNodeHealth` records in flight, on a node cordoned for it (or, for a
//! reset or a diagnostic, with the GPUs it names fenced for it alone). A
//! diagnostic is the recorded action's, asked while the node is verifying
//! it. Many
//! identities may patch a Node; only the operator may write a
//! `GpuNodeHealth`'s status (RBAC), and it records each request there before
//! writing it to the Node. A request that does not match is refused: a
//! write by anyone else would bypass drains, budgets and the breaker.

use gpuhealth_api::{
    GpuNodeHealthStatus, RecoveryAction,
    contract::{AnnotationValue, CordonRecord, RequestId},
    node_health::{ActionStatus, Phase},
};
use k8s_openapi::api::core::v1::Node;
use kube::ResourceExt;

/// Why a request is not carried out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No `GpuNodeHealth` for the node, or no status yet.
    NoRecord,
    /// The record has no request in flight, or another one.
    NotInFlight { recorded: Option<RequestId> },
    /// The record's request is of the other kind, or for other GPUs.
    Differs(String),
    /// The node is schedulable and the GPUs are not fenced for this
    /// request: nothing was drained for it.
    NotCordoned,
    /// gpuhealth's cordon record names another incident, one the record
    /// does not show closed.
    CordonedForAnother(String),
}

impl Refusal {
    /// Every [`Refusal::reason`], for the metric's series to exist at 0.
    pub const REASONS: [&'static str; 5] = [
        "NoRecord",
        "NotInFlight",
        "Differs",
        "NotCordoned",
        "CordonedForAnother",
    ];

    /// A short, stable label for the metric.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::NoRecord => "NoRecord",
            Refusal::NotInFlight { .. } => "NotInFlight",
            Refusal::Differs(_) => "Differs",
            Refusal::NotCordoned => "NotCordoned",
            Refusal::CordonedForAnother(_) => "CordonedForAnother",
        }
    }

    pub fn message(&self, id: &RequestId) -> String {
        let why = match self {
            Refusal::NoRecord => "the node's GpuNodeHealth records no request".to_owned(),
            Refusal::NotInFlight { recorded: None } => {
                "the node's GpuNodeHealth records no request in flight".to_owned()
            }
            Refusal::NotInFlight {
                recorded: Some(other),
            } => format!("the node's GpuNodeHealth records {other} in flight, not this one"),
            Refusal::Differs(what) => what.clone(),
            Refusal::NotCordoned => {
                "the node is not cordoned, nor its GPUs fenced for this incident".to_owned()
            }
            Refusal::CordonedForAnother(incident) => {
                format!("gpuhealth cordoned the node for incident {incident}, not this request's")
            }
        };
        format!(
            "request {id} refused: {why}; only the gpuhealth operator's requests are carried out"
        )
    }
}

/// What the request asks for.
#[derive(Clone, Copy, Debug)]
pub enum Asked<'a> {
    Reset {
        gpus: &'a [String],
    },
    Reboot,
    /// DCGM's diagnostic on the GPUs the recorded action repaired.
    Diagnostics {
        gpus: &'a [String],
    },
}

impl Asked<'_> {
    /// The phase the record is in while this is asked: a diagnostic
    /// follows the action, while the node is verifying it.
    fn phase(self) -> Phase {
        match self {
            Asked::Diagnostics { .. } => Phase::Verifying,
            Asked::Reset { .. } | Asked::Reboot => Phase::Remediating,
        }
    }

    /// The id of this kind of request for the recorded `action`.
    fn id_for(self, action: &ActionStatus) -> RequestId {
        match self {
            Asked::Diagnostics { .. } => RequestId::for_diagnostics(&action.id),
            Asked::Reset { .. } | Asked::Reboot => action.id.clone(),
        }
    }
}

/// `Ok` when `id` is the request `health` records in flight on a node
/// cordoned for its incident (by gpuhealth, or by someone else before it:
/// gpuhealth then takes that cordon as its quarantine and writes no record),
/// or a reset or diagnostic of GPUs the record says are fenced alone for
/// that incident. A diagnostic's id is the recorded action's
/// ([`RequestId::for_diagnostics`]), asked in `Verifying`.
pub fn check(
    id: &RequestId,
    asked: Asked<'_>,
    node: &Node,
    health: Option<&GpuNodeHealthStatus>,
) -> Result<(), Refusal> {
    let health = health.ok_or(Refusal::NoRecord)?;
    let action = health
        .action
        .as_ref()
        .filter(|a| a.requested_at.is_some() && health.phase == asked.phase());
    let Some(action) = action.filter(|a| &asked.id_for(a) == id) else {
        return Err(Refusal::NotInFlight {
            recorded: action.map(|a| asked.id_for(a)),
        });
    };
    match (asked, action.type_) {
        // After either rung, on the GPUs it named (none: not a diagnostic's).
        (Asked::Diagnostics { gpus }, _)
            if action.gpus.is_empty() || gpus != action.gpus.as_slice() =>
        {
            return Err(Refusal::Differs(format!(
                "it names GPUs {gpus:?}, the record {:?}",
                action.gpus
            )));
        }
        (Asked::Diagnostics { .. }, _) => {}
        (Asked::Reset { gpus }, RecoveryAction::GpuReset) if gpus != action.gpus.as_slice() => {
            return Err(Refusal::Differs(format!(
                "it names GPUs {gpus:?}, the record {:?}",
                action.gpus
            )));
        }
        (Asked::Reset { .. }, RecoveryAction::GpuReset)
        | (Asked::Reboot, RecoveryAction::NodeReboot) => {}
        (_, recorded) => {
            return Err(Refusal::Differs(format!(
                "the record's request in flight is a {recorded:?}"
            )));
        }
    }
    if let Asked::Reset { gpus } | Asked::Diagnostics { gpus } = asked
        && fenced_for(health, gpus)
    {
        return Ok(());
    }
    if !node
        .spec
        .as_ref()
        .and_then(|s| s.unschedulable)
        .unwrap_or(false)
    {
        return Err(Refusal::NotCordoned);
    }
    let record = node
        .annotations()
        .get(CordonRecord::ANNOTATION)
        .and_then(|v| CordonRecord::parse(v).ok());
    // A record naming an incident the history shows closed is stale: a
    // person's `kubectl uncordon` after a hand-over leaves it, and the
    // cordon is now someone else's (kept by this incident).
    let closed = |incident: &str| {
        health
            .history
            .iter()
            .any(|i| i.id == incident && i.outcome.is_some())
    };
    match (record, &health.incident) {
        (Some(r), Some(incident))
            if r.incident.as_str() != incident && !closed(r.incident.as_str()) =>
        {
            Err(Refusal::CordonedForAnother(r.incident.to_string()))
        }
        _ => Ok(()),
    }
}

/// Whether the record fences each of `gpus` alone for its open incident.
fn fenced_for(health: &GpuNodeHealthStatus, gpus: &[String]) -> bool {
    health.quarantine.as_ref().is_some_and(|q| {
        q.per_gpu()
            && health.incident.as_deref() == Some(q.incident.as_str())
            && !gpus.is_empty()
            && gpus.iter().all(|g| q.gpus.iter().any(|f| &f.uuid == g))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpuhealth_api::node_health::ActionStatus;
    use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
    use serde_json::json;

    fn id(s: &str) -> RequestId {
        s.parse().expect("id")
    }

    fn node(cordoned: bool, record: Option<&str>) -> Node {
        let mut annotations = serde_json::Map::new();
        if let Some(incident) = record {
            annotations.insert(
                CordonRecord::ANNOTATION.into(),
                json!(format!(
                    r#"{{"incident":"{incident}","at":"2026-12-01T00:00:00Z"}}"#
                )),
            );
        }
        serde_json::from_value(json!({
            "metadata": {"name": "n", "annotations": annotations},
            "spec": {"unschedulable": cordoned},
        }))
        .expect("node")
    }

    fn in_flight(action: RecoveryAction, request: &str) -> GpuNodeHealthStatus {
        GpuNodeHealthStatus {
            phase: Phase::Remediating,
            incident: Some("inc-1".into()),
            action: Some(ActionStatus {
                id: request.parse().expect("an id"),
                type_: action,
                attempt: 1,
                gpus: vec!["GPU-7".into()],
                started_at: Time(Timestamp::UNIX_EPOCH),
                requested_at: Some(Time(Timestamp::UNIX_EPOCH)),
                deadline: None,
            }),
            ..Default::default()
        }
    }

    const GPU7: &[String] = &[];

    #[test]
    fn the_recorded_request_on_a_node_cordoned_for_it_is_carried_out() {
        let gpus = vec!["GPU-7".to_owned()];
        let health = in_flight(RecoveryAction::GpuReset, "inc-1-reset-1");
        let asked = Asked::Reset { gpus: &gpus };
        for n in [node(true, Some("inc-1")), node(true, None)] {
            assert_eq!(
                check(&id("inc-1-reset-1"), asked, &n, Some(&health)),
                Ok(())
            );
        }
        let health = in_flight(RecoveryAction::NodeReboot, "inc-1-reboot-1");
        let n = node(true, Some("inc-1"));
        assert_eq!(
            check(&id("inc-1-reboot-1"), Asked::Reboot, &n, Some(&health)),
            Ok(())
        );
    }

    #[test]
    fn a_cordon_record_left_by_a_closed_incident_is_stale_and_an_open_ones_is_not() {
        use gpuhealth_api::{node_health::Incident, vocabulary::IncidentOutcome};
        let gpus = vec!["GPU-7".to_owned()];
        let reset = Asked::Reset { gpus: &gpus };
        let request = id("inc-1-reset-1");
        // A person re-cordoned a node whose last incident was handed over:
        // the record still names that incident.
        let recordoned = node(true, Some("inc-0"));
        let mut health = in_flight(RecoveryAction::GpuReset, "inc-1-reset-1");
        let past = |outcome| Incident {
            id: "inc-0".into(),
            started_at: Time(Timestamp::UNIX_EPOCH),
            ended_at: None,
            trigger: String::new(),
            signals: Vec::new(),
            attempts: Vec::new(),
            actions: Vec::new(),
            outcome,
            gpus: Vec::new(),
            maintenance_deadline: None,
            workloads: None,
            gangs: Vec::new(),
        };
        health.history = vec![past(None)];
        assert_eq!(
            check(&request, reset, &recordoned, Some(&health))
                .expect_err("an incident not closed")
                .reason(),
            "CordonedForAnother"
        );
        health.history = vec![past(Some(IncidentOutcome::Failed))];
        assert_eq!(check(&request, reset, &recordoned, Some(&health)), Ok(()));
    }

    #[test]
    fn anything_else_is_refused_with_its_reason() {
        let gpus = vec!["GPU-7".to_owned()];
        let reset = Asked::Reset { gpus: &gpus };
        let health = in_flight(RecoveryAction::GpuReset, "inc-1-reset-1");
        let cordoned = node(true, Some("inc-1"));
        let request = id("inc-1-reset-1");
        let reason = |r: Result<(), Refusal>| r.expect_err("refused").reason();

        assert_eq!(reason(check(&request, reset, &cordoned, None)), "NoRecord");
        for r in [
            Refusal::NoRecord,
            Refusal::NotInFlight { recorded: None },
            Refusal::Differs(String::new()),
            Refusal::NotCordoned,
            Refusal::CordonedForAnother(String::new()),
        ] {
            assert!(Refusal::REASONS.contains(&r.reason()), "{r:?}");
        }
        assert_eq!(
            reason(check(&id("inc-1-reset-2"), reset, &cordoned, Some(&health))),
            "NotInFlight"
        );
        let mut verifying = health.clone();
        verifying.phase = Phase::Verifying;
        assert_eq!(
            reason(check(&request, reset, &cordoned, Some(&verifying))),
            "NotInFlight"
        );
        assert_eq!(
            reason(check(&request, Asked::Reboot, &cordoned, Some(&health))),
            "Differs"
        );
        let other = vec!["GPU-0".to_owned()];
        assert_eq!(
            reason(check(
                &request,
                Asked::Reset { gpus: &other },
                &cordoned,
                Some(&health)
            )),
            "Differs"
        );
        assert_eq!(
            reason(check(
                &request,
                Asked::Reset { gpus: GPU7 },
                &cordoned,
                Some(&health)
            )),
            "Differs"
        );
        assert_eq!(
            reason(check(
                &request,
                reset,
                &node(false, Some("inc-1")),
                Some(&health)
            )),
            "NotCordoned"
        );
        assert_eq!(
            reason(check(
                &request,
                reset,
                &node(true, Some("inc-0")),
                Some(&health)
            )),
            "CordonedForAnother"
        );
        let message = check(&request, reset, &node(false, None), Some(&health))
            .expect_err("refused")
            .message(&request);
        assert!(
            message.contains("inc-1-reset-1 refused: the node is not cordoned"),
            "{message}"
        );
    }

    #[test]
    fn a_reset_of_gpus_fenced_alone_for_the_incident_needs_no_cordon() {
        use gpuhealth_api::{
            quarantine::{Fenced, FencedGpu, GpuFence, QuarantineStatus},
            vocabulary::{DeviceId, QuarantineWhy},
        };
        let gpus = vec!["GPU-7".to_owned()];
        let reset = Asked::Reset { gpus: &gpus };
        let request = id("inc-1-reset-1");
        let schedulable = node(false, None);
        let mut health = in_flight(RecoveryAction::GpuReset, "inc-1-reset-1");
        let fenced = |incident: &str, uuid: &str| QuarantineStatus {
            incident: incident.into(),
            scope: Fenced::Gpu,
            why: QuarantineWhy::GpusFenced,
            message: String::new(),
            gpus: vec![FencedGpu {
                uuid: uuid.into(),
                index: Some(7),
                fence: GpuFence::DeviceTaintRule,
                device: Some(DeviceId::new("gpu.nvidia.com", "n", "gpu-7")),
                rule: Some("gpuhealth-inc-1-gpu-7".into()),
            }],
            since: Time(Timestamp::UNIX_EPOCH),
            lifted_at: None,
        };
        health.quarantine = Some(fenced("inc-1", "GPU-7"));
        assert_eq!(check(&request, reset, &schedulable, Some(&health)), Ok(()));

        // Fenced for another incident, another GPU, or lifted: not enough.
        for q in [fenced("inc-0", "GPU-7"), fenced("inc-1", "GPU-0")] {
            health.quarantine = Some(q);
            assert_eq!(
                check(&request, reset, &schedulable, Some(&health)),
                Err(Refusal::NotCordoned)
            );
        }
        let mut lifted = fenced("inc-1", "GPU-7");
        lifted.lifted_at = Some(Time(Timestamp::UNIX_EPOCH));
        health.quarantine = Some(lifted);
        assert_eq!(
            check(&request, reset, &schedulable, Some(&health)),
            Err(Refusal::NotCordoned)
        );
        // A reboot needs the node.
        let mut reboot = in_flight(RecoveryAction::NodeReboot, "inc-1-reboot-1");
        reboot.quarantine = Some(fenced("inc-1", "GPU-7"));
        assert_eq!(
            check(
                &id("inc-1-reboot-1"),
                Asked::Reboot,
                &schedulable,
                Some(&reboot)
            ),
            Err(Refusal::NotCordoned)
        );
    }

    fn verifying(action: RecoveryAction, request: &str) -> GpuNodeHealthStatus {
        let mut health = in_flight(action, request);
        health.phase = Phase::Verifying;
        health
    }

    #[test]
    fn a_diagnostic_of_the_repaired_gpus_while_verifying_is_carried_out() {
        let gpus = vec!["GPU-7".to_owned()];
        let asked = Asked::Diagnostics { gpus: &gpus };
        let request = id("inc-1-reset-1-diagnostics");
        let cordoned = node(true, Some("inc-1"));
        let health = verifying(RecoveryAction::GpuReset, "inc-1-reset-1");
        assert_eq!(check(&request, asked, &cordoned, Some(&health)), Ok(()));
        // After a reboot that named the GPUs, too.
        let health = verifying(RecoveryAction::NodeReboot, "inc-1-reboot-1");
        assert_eq!(
            check(
                &id("inc-1-reboot-1-diagnostics"),
                asked,
                &cordoned,
                Some(&health)
            ),
            Ok(())
        );
    }

    #[test]
    fn a_diagnostic_is_refused_in_the_wrong_phase_id_or_gpus_or_uncordoned() {
        let gpus = vec!["GPU-7".to_owned()];
        let asked = Asked::Diagnostics { gpus: &gpus };
        let request = id("inc-1-reset-1-diagnostics");
        let cordoned = node(true, Some("inc-1"));
        let health = verifying(RecoveryAction::GpuReset, "inc-1-reset-1");
        let reason = |r: Result<(), Refusal>| r.expect_err("refused").reason();

        // While the reset itself is in flight.
        let remediating = in_flight(RecoveryAction::GpuReset, "inc-1-reset-1");
        assert_eq!(
            reason(check(&request, asked, &cordoned, Some(&remediating))),
            "NotInFlight"
        );
        // Another attempt's, or the action's own id.
        for other in ["inc-1-reset-2-diagnostics", "inc-1-reset-1"] {
            assert_eq!(
                check(&id(other), asked, &cordoned, Some(&health)),
                Err(Refusal::NotInFlight {
                    recorded: Some(request.clone())
                })
            );
        }
        // Other GPUs, or an action on the whole node.
        let other = vec!["GPU-0".to_owned()];
        assert_eq!(
            reason(check(
                &request,
                Asked::Diagnostics { gpus: &other },
                &cordoned,
                Some(&health)
            )),
            "Differs"
        );
        let mut whole_node = verifying(RecoveryAction::NodeReboot, "inc-1-reboot-1");
        if let Some(a) = whole_node.action.as_mut() {
            a.gpus.clear();
        }
        assert_eq!(
            reason(check(
                &id("inc-1-reboot-1-diagnostics"),
                asked,
                &cordoned,
                Some(&whole_node)
            )),
            "Differs"
        );
        assert_eq!(
            reason(check(
                &request,
                asked,
                &node(false, Some("inc-1")),
                Some(&health)
            )),
            "NotCordoned"
        );
        assert_eq!(
            reason(check(
                &request,
                asked,
                &node(true, Some("inc-0")),
                Some(&health)
            )),
            "CordonedForAnother"
        );
    }

    #[test]
    fn a_diagnostic_of_gpus_fenced_alone_for_the_incident_needs_no_cordon() {
        use gpuhealth_api::{
            quarantine::{Fenced, FencedGpu, GpuFence, QuarantineStatus},
            vocabulary::QuarantineWhy,
        };
        let gpus = vec!["GPU-7".to_owned()];
        let asked = Asked::Diagnostics { gpus: &gpus };
        let request = id("inc-1-reset-1-diagnostics");
        let schedulable = node(false, None);
        let mut health = verifying(RecoveryAction::GpuReset, "inc-1-reset-1");
        let fenced = |incident: &str| QuarantineStatus {
            incident: incident.into(),
            scope: Fenced::Gpu,
            why: QuarantineWhy::GpusFenced,
            message: String::new(),
            gpus: vec![FencedGpu {
                uuid: "GPU-7".into(),
                index: Some(7),
                fence: GpuFence::DeviceTaintRule,
                device: None,
                rule: None,
            }],
            since: Time(Timestamp::UNIX_EPOCH),
            lifted_at: None,
        };
        health.quarantine = Some(fenced("inc-1"));
        assert_eq!(check(&request, asked, &schedulable, Some(&health)), Ok(()));
        health.quarantine = Some(fenced("inc-0"));
        assert_eq!(
            check(&request, asked, &schedulable, Some(&health)),
            Err(Refusal::NotCordoned)
        );
    }
}
