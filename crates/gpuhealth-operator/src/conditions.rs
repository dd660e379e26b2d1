//! Status conditions of a policy.

use gpuhealth_engine::budget::Budget;
use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
    jiff::Timestamp,
};

/// `CircuitOpen`: True while more nodes are unhealthy than `maxUnhealthy`
/// allows. The transition time moves only when the status does.
pub fn circuit_open(previous: &[Condition], budget: &Budget, generation: Option<i64>) -> Condition {
    let open = budget.circuit_open();
    let (status, reason, message) = if open {
        (
            "True",
            "TooManyUnhealthy",
            format!(
                "{} nodes are unhealthy, more than maxUnhealthy allows ({}): no new remediation starts until some recover",
                budget.unhealthy, budget.max_unhealthy
            ),
        )
    } else {
        (
            "False",
            "WithinBudget",
            format!(
                "{} of at most {} nodes unhealthy",
                budget.unhealthy, budget.max_unhealthy
            ),
        )
    };
    let last = previous.iter().find(|c| c.type_ == "CircuitOpen");
    let since = match last {
        Some(c) if c.status == status => c.last_transition_time.clone(),
        _ => Time(Timestamp::now()),
    };
    Condition {
        type_: "CircuitOpen".into(),
        status: status.into(),
        reason: reason.into(),
        message,
        last_transition_time: since,
        observed_generation: generation,
    }
}
