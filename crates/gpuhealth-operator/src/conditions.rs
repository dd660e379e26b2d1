//! Status conditions of a policy: `Ready`, `CircuitOpen` and `Conflict`.

use gpuhealth_api::vocabulary::{PolicyCondition, Reason};
use gpuhealth_engine::{
    budget::Budget,
    honour::{self, Problem},
};
use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
    jiff::Timestamp,
};

/// A condition whose transition time moves only when its status does.
fn condition(
    previous: &[Condition],
    type_: PolicyCondition,
    status: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
) -> Condition {
    let status = if status { "True" } else { "False" };
    let since = match previous.iter().find(|c| c.type_ == type_.as_str()) {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => Time(Timestamp::now()),
    };
    Condition {
        type_: type_.as_str().into(),
        status: status.into(),
        reason: reason.into(),
        message,
        last_transition_time: since,
        observed_generation: generation,
    }
}

/// `Ready`: the policy can be applied as written. False with
/// `InvalidSelector` when its selector cannot be used (it manages no node),
/// else with `CannotHonour` while some field of it cannot be honoured
/// (`problems`, each named by its field; the rest of the policy applies).
pub fn ready(
    previous: &[Condition],
    unprotected: Option<String>,
    past_guardrails: &[Problem],
    selector_error: Option<String>,
    problems: &[Problem],
    managed: usize,
    generation: Option<i64>,
) -> Condition {
    let unhonoured = honour::message(problems);
    if let Some(why) = unprotected {
        return condition(
            previous,
            PolicyCondition::Ready,
            false,
            // The word the nodes it holds give too.
            Reason::Unprotected.as_str(),
            format!("gpuhealth enforces nothing until its admission protection is in force: {why}"),
            generation,
        );
    }
    if let Some(past) = honour::message(past_guardrails) {
        return condition(
            previous,
            PolicyCondition::Ready,
            false,
            // The word the nodes it holds give too.
            Reason::PastGuardrail.as_str(),
            format!(
                "the policy enforces nothing while it is past the cluster's guardrails: {past}"
            ),
            generation,
        );
    }
    match (selector_error, unhonoured) {
        (Some(e), unhonoured) => condition(
            previous,
            PolicyCondition::Ready,
            false,
            "InvalidSelector",
            format!(
                "nodeSelector cannot be used, so the policy manages no node: {e}{}",
                unhonoured.map(|m| format!("; {m}")).unwrap_or_default()
            ),
            generation,
        ),
        (None, Some(m)) => condition(
            previous,
            PolicyCondition::Ready,
            false,
            honour::REASON,
            m,
            generation,
        ),
        (None, None) => condition(
            previous,
            PolicyCondition::Ready,
            true,
            "Managing",
            format!("managing {managed} node(s)"),
            generation,
        ),
    }
}

/// `CircuitOpen`: True while more nodes are unhealthy than `maxUnhealthy`
/// allows.
pub fn circuit_open(previous: &[Condition], budget: &Budget, generation: Option<i64>) -> Condition {
    if budget.circuit_open() {
        condition(
            previous,
            PolicyCondition::CircuitOpen,
            true,
            "TooManyUnhealthy",
            format!(
                "{} nodes are unhealthy, more than maxUnhealthy allows ({}): no new remediation starts until some recover",
                budget.unhealthy, budget.max_unhealthy
            ),
            generation,
        )
    } else {
        condition(
            previous,
            PolicyCondition::CircuitOpen,
            false,
            "WithinBudget",
            format!(
                "{} of at most {} nodes unhealthy",
                budget.unhealthy, budget.max_unhealthy
            ),
            generation,
        )
    }
}

/// `Conflict`: True while other policies manage some of the nodes this one
/// selects. `lost_to` is (winning policy, nodes it took), by policy name.
pub fn conflict(
    previous: &[Condition],
    lost_to: &[(String, usize)],
    generation: Option<i64>,
) -> Condition {
    if lost_to.is_empty() {
        return condition(
            previous,
            PolicyCondition::Conflict,
            false,
            "NoOverlap",
            "no other policy manages a node this one selects".into(),
            generation,
        );
    }
    let winners: Vec<String> = lost_to
        .iter()
        .map(|(policy, n)| format!("{n} by {policy}"))
        .collect();
    condition(
        previous,
        PolicyCondition::Conflict,
        true,
        "Overlap",
        format!(
            "nodes this policy selects are managed by a policy with higher priority (or equal priority and an earlier name): {}; raise spec.priority or narrow a nodeSelector",
            winners.join(", ")
        ),
        generation,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_names_what_cannot_be_honoured_and_a_bad_selector_comes_first() {
        let zone = Problem::new(
            "spec.maintenanceWindows[1].timeZone",
            "unknown time zone \"Mars/Base\"",
        );
        let lock = Problem::new("spec.otherActors[1].object", "cannot be read");
        let c = ready(
            &[],
            None,
            &[],
            None,
            &[zone.clone(), lock.clone()],
            3,
            Some(2),
        );
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "CannotHonour")
        );
        assert_eq!(
            c.message,
            "spec.maintenanceWindows[1].timeZone: unknown time zone \"Mars/Base\"; spec.otherActors[1].object: cannot be read"
        );
        assert_eq!(c.observed_generation, Some(2));

        let c = ready(
            &[],
            None,
            &[],
            Some("bad operator".into()),
            &[zone],
            0,
            None,
        );
        assert_eq!(
            (c.status.as_str(), c.reason.as_str()),
            ("False", "InvalidSelector")
        );
        assert!(
            c.message.ends_with(
                "bad operator; spec.maintenanceWindows[1].timeZone: unknown time zone \"Mars/Base\""
            ),
            "{}",
            c.message
        );

        // Without protection, that is what it says first.
        let unprotected = ready(
            &[],
            Some("no binding".into()),
            &[],
            Some("bad operator".into()),
            &[],
            3,
            None,
        );
        assert_eq!(
            (unprotected.status.as_str(), unprotected.reason.as_str()),
            ("False", Reason::Unprotected.as_str())
        );
        assert!(
            unprotected.message.ends_with(": no binding"),
            "{}",
            unprotected.message
        );

        // Past a guardrail: named before what cannot be honoured.
        let past = ready(
            &[],
            None,
            &[Problem::new(
                "spec.acknowledgeFleetWide",
                "selects 101 nodes",
            )],
            None,
            &[],
            101,
            None,
        );
        assert_eq!(
            (past.status.as_str(), past.reason.as_str()),
            ("False", Reason::PastGuardrail.as_str())
        );
        assert!(
            past.message
                .ends_with("spec.acknowledgeFleetWide: selects 101 nodes"),
            "{}",
            past.message
        );

        let fixed = ready(std::slice::from_ref(&c), None, &[], None, &[], 3, None);
        assert_eq!(
            (fixed.status.as_str(), fixed.reason.as_str()),
            ("True", "Managing")
        );
        assert_eq!(fixed.message, "managing 3 node(s)");
    }
}
