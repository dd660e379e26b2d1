//! What can go wrong in a reconcile, and how soon each kind is tried again.

use std::{collections::HashMap, sync::Mutex, time::Duration};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("serialising: {0}")]
    Json(#[from] serde_json::Error),
    /// Never written: the agent would refuse it, and the operator, seeing no
    /// request it can read, would ask again on every reconcile.
    #[error("the engine made a request the agent would refuse: {0}")]
    InvalidRequest(String),
    #[error("not the leader: this replica does not act")]
    NotLeader,
}

impl Error {
    /// Every [`Error::metric_label`].
    pub const KINDS: &'static [&'static str] = &["kube", "json", "invalid_request", "not_leader"];

    /// A short, stable label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::Json(_) => "json",
            Error::InvalidRequest(_) => "invalid_request",
            Error::NotLeader => "not_leader",
        }
    }
}

/// How soon a reconcile that failed is tried again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Retry {
    /// Soon: someone else wrote first, and the next read shows it.
    Soon,
    /// Later, and later each time: the API server is failing or throttling.
    BackOff,
    /// Only when something it reads changes: trying the same input again
    /// would fail the same way.
    OnChange,
    /// After a while: this replica is not the leader (now).
    Standby,
}

impl Error {
    pub fn retry(&self) -> Retry {
        match self {
            Error::Kube(kube::Error::Api(s)) if s.code == 409 => Retry::Soon,
            Error::Kube(kube::Error::Api(s)) if matches!(s.code, 400 | 422) => Retry::OnChange,
            Error::Kube(_) => Retry::BackOff,
            Error::Json(_) | Error::InvalidRequest(_) => Retry::OnChange,
            Error::NotLeader => Retry::Standby,
        }
    }
}

impl Retry {
    /// The delay after `failures` failures in a row (1 for the first), or
    /// None to wait for a change.
    pub fn after(self, failures: u32) -> Option<Duration> {
        match self {
            Retry::Soon => Some(Duration::from_secs(1)),
            Retry::Standby => Some(Duration::from_secs(5)),
            Retry::OnChange => None,
            // 2 s, 4 s, ... up to a minute.
            Retry::BackOff => {
                let exponent = failures.clamp(1, 6);
                Some(Duration::from_secs(1 << exponent).min(Duration::from_secs(60)))
            }
        }
    }
}

/// Failures in a row, per object, for the back-off.
#[derive(Default)]
pub struct Failures(Mutex<HashMap<String, u32>>);

impl Failures {
    pub fn one_more(&self, name: &str) -> u32 {
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = all.entry(name.to_owned()).or_default();
        *n = n.saturating_add(1);
        *n
    }

    /// A reconcile of `name` succeeded: its back-off starts over.
    pub fn forget(&self, name: &str) {
        let mut all = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if !all.is_empty() {
            all.remove(name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(code: u16) -> Error {
        Error::Kube(kube::Error::Api(
            kube::core::Status::failure("test", "Test")
                .with_code(code)
                .boxed(),
        ))
    }

    #[test]
    fn each_kind_of_error_is_tried_again_in_its_own_time() {
        assert_eq!(api(409).retry().after(1), Some(Duration::from_secs(1)));
        assert_eq!(api(422).retry().after(1), None);
        assert_eq!(Error::InvalidRequest("x".into()).retry().after(3), None);
        assert_eq!(api(500).retry().after(1), Some(Duration::from_secs(2)));
        assert_eq!(api(503).retry().after(3), Some(Duration::from_secs(8)));
        assert_eq!(api(429).retry().after(50), Some(Duration::from_secs(60)));
        assert_eq!(
            Error::NotLeader.retry().after(9),
            Some(Duration::from_secs(5))
        );
    }
}
