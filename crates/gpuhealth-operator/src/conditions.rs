//! Status conditions of a policy: `Ready`, `CircuitOpen` and `Conflict`.

use gpuhealth_engine::budget::Budget;
use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
    jiff::Timestamp,
};

/// A condition whose transition time moves only when its status does.
fn condition(
    previous: &[Condition],
    type_: &str,
    status: bool,
    reason: &str,
    message: String,
    generation: Option<i64>,
) -> Condition {
    let status = if status { "True" } else { "False" };
    let since = match previous.iter().find(|c| c.type_ == type_) {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => Time(Timestamp::now()),
    };
    Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message,
        last_transition_time: since,
        observed_generation: generation,
    }
}

/// `Ready`: the policy can be applied (its selector is valid).
pub fn ready(
    previous: &[Condition],
    selector_error: Option<String>,
    managed: usize,
    generation: Option<i64>,
) -> Condition {
    match selector_error {
        Some(e) => condition(
            previous,
            "Ready",
            false,
            "InvalidSelector",
            format!("nodeSelector cannot be used, so the policy manages no node: {e}"),
            generation,
        ),
        None => condition(
            previous,
            "Ready",
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
            "CircuitOpen",
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
            "CircuitOpen",
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
            "Conflict",
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
        "Conflict",
        true,
        "Overlap",
        format!(
            "nodes this policy selects are managed by a policy with higher priority (or equal priority and an earlier name): {}; raise spec.priority or narrow a nodeSelector",
            winners.join(", ")
        ),
        generation,
    )
}
