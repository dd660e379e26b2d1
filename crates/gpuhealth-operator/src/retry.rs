//! A failed reconcile, counted and tried again in its kind's time.

use kube::runtime::controller::Action as Requeue;
use tracing::{debug, warn};

use crate::{
    context::{Context, Error},
    metrics::ErrorLabels,
};

/// The back-off's key for `name`, a `what`.
fn key(what: &str, name: &str) -> String {
    format!("{what}/{name}")
}

/// After a reconcile of `name` (a `what`): one that succeeded starts its
/// back-off over.
pub fn settled<T>(ctx: &Context, what: &str, name: &str, result: &Result<T, Error>) {
    if result.is_ok() {
        ctx.failures.forget(&key(what, name));
    }
}

/// Counts a failed reconcile of `name` (a `what`) and says when to try again.
pub fn retry(name: &str, what: &str, error: &Error, ctx: &Context) -> Requeue {
    let kind = error.metric_label();
    ctx.metrics
        .reconcile_errors
        .get_or_create(&ErrorLabels {
            stage: error.stage().as_str(),
            kind,
        })
        .inc();
    let retry = error.retry();
    let after = retry.after(ctx.failures.one_more(&key(what, name)));
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
