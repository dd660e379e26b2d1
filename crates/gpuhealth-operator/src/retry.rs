//! A failed reconcile, counted and tried again in its kind's time.

use kube::runtime::controller::Action as Requeue;
use tracing::{debug, warn};

use crate::{
    context::{Context, Error},
    error::Subject,
    metrics::ErrorLabels,
};

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
