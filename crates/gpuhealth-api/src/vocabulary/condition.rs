//! The conditions a policy's status carries: `status.conditions[].type`.

use super::words;

words! {
    /// A condition of a `GpuHealthPolicy`'s status.
    pub enum PolicyCondition {
        /// The policy can be applied as written (its reason says why not).
        Ready,
        /// The circuit breaker is open: no new remediation starts.
        CircuitOpen,
        /// A node it selects is managed by another policy.
        Conflict,
    }
}
