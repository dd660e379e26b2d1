//! A failed reconcile, counted and tried again in its kind's time.

use std::{collections::HashMap, sync::Mutex};

use kube::runtime::controller::Action as Requeue;
use tracing::{debug, warn};

use crate::{
    context::{Context, Error},
    metrics::ErrorLabels,
};

/// What a controller reconciles: each counts its own failures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Subject {
    Node,
    Policy,
}

impl Subject {
    fn as_str(self) -> &'static str {
        match self {
            Subject::Node => "node",
            Subject::Policy => "policy",
        }
    }
}

/// Failures in a row, per object, for the back-off.
#[derive(Default)]
pub struct Failures(Mutex<HashMap<(Subject, String), u32>>);

impl Failures {
    fn one_more(&self, subject: Subject, name: &str) -> u32 {
        let mut all = self.lock();
        let n = all.entry((subject, name.to_owned())).or_default();
        *n = n.saturating_add(1);
        *n
    }

    /// A reconcile of `name` succeeded: its back-off starts over.
    fn forget(&self, subject: Subject, name: &str) {
        let mut all = self.lock();
        if !all.is_empty() {
            all.remove(&(subject, name.to_owned()));
        }
    }

    /// Forgets every node `still_there` does not name: a node deleted while
    /// its reconciles failed is never reconciled again to start over.
    pub fn forget_gone(&self, still_there: impl Fn(&str) -> bool) {
        self.lock()
            .retain(|(subject, name), _| *subject != Subject::Node || still_there(name));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(Subject, String), u32>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// After a reconcile of `name`: one that succeeded starts its back-off over.
pub fn settled<T>(ctx: &Context, subject: Subject, name: &str, result: &Result<T, Error>) {
    if result.is_ok() {
        ctx.failures.forget(subject, name);
    }
}

/// Counts a failed reconcile of `name` and says when to try again.
pub fn retry(name: &str, subject: Subject, error: &Error, ctx: &Context) -> Requeue {
    let kind = error.metric_label();
    ctx.metrics
        .reconcile_errors
        .get_or_create(&ErrorLabels {
            stage: error.stage().as_str(),
            kind,
        })
        .inc();
    let retry = error.retry();
    let after = retry.after(ctx.failures.one_more(subject, name));
    let what = subject.as_str();
    match error {
        // Expected on a standby replica, or for the moment after losing the lease.
        Error::NotLeader => debug!(%name, what, "not the leader; not acting"),
        _ => {
            warn!(%name, what, error = %error, kind, stage = error.stage().as_str(), ?retry, ?after, "reconcile failed")
        }
    }
    match after {
        Some(after) => Requeue::requeue(after),
        None => Requeue::await_change(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_count_per_subject_and_go_with_a_deleted_node() {
        let failures = Failures::default();
        assert_eq!(failures.one_more(Subject::Node, "gpu-1"), 1);
        assert_eq!(failures.one_more(Subject::Node, "gpu-1"), 2);
        assert_eq!(
            failures.one_more(Subject::Policy, "gpu-1"),
            1,
            "its own count"
        );
        assert_eq!(failures.one_more(Subject::Node, "gpu-2"), 1);

        failures.forget_gone(|n| n == "gpu-2");
        assert_eq!(failures.one_more(Subject::Node, "gpu-1"), 1, "gpu-1 went");
        assert_eq!(failures.one_more(Subject::Node, "gpu-2"), 2, "gpu-2 kept");
        assert_eq!(
            failures.one_more(Subject::Policy, "gpu-1"),
            2,
            "a policy is not a node"
        );

        failures.forget(Subject::Node, "gpu-2");
        assert_eq!(failures.one_more(Subject::Node, "gpu-2"), 1, "starts over");
    }
}
