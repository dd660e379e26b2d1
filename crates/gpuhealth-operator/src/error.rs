//! What can go wrong in a reconcile, where, and how soon each kind is
//! tried again.

use std::{collections::HashMap, time::Duration};

use gpuhealth_engine::machine::ActionKind;
use parking_lot::{Mutex, MutexGuard};

/// A failed reconcile, with the stage that failed and what it failed on.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading what a node's step needs (its pods, gangs, workloads, the
    /// validation pod, the last look before a request).
    #[error("reading for node {node}: {source}")]
    Read { node: String, source: kube::Error },
    /// Writing a node's decided status: nothing was acted on.
    #[error("writing the status of node {node}: {source}")]
    WriteStatus { node: String, source: kube::Error },
    /// Carrying out one of a recorded decision's actions.
    #[error("{action} on node {node}: {source}")]
    Act {
        node: String,
        action: ActionKind,
        source: kube::Error,
    },
    /// Never written: the agent would refuse it, and the operator, seeing no
    /// request it can read, would ask again on every reconcile.
    #[error("{action} on node {node}: the engine made a request the agent would refuse: {why}")]
    InvalidRequest {
        node: String,
        action: ActionKind,
        why: String,
    },
    /// Writing a policy's status.
    #[error("writing the status of policy {policy}: {source}")]
    PolicyStatus { policy: String, source: kube::Error },
    /// Closing the record of a node deleted from the cluster.
    #[error("the record of deleted node {node}: {source}")]
    NodeDeleted { node: String, source: kube::Error },
    #[error("not the leader: this replica does not act")]
    NotLeader,
}

/// Where a reconcile failed: the `stage` label of its error metric.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Read,
    WriteStatus,
    Act,
    PolicyStatus,
    NodeDeleted,
    Leadership,
}

impl Stage {
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Read => "read",
            Stage::WriteStatus => "write_status",
            Stage::Act => "act",
            Stage::PolicyStatus => "policy_status",
            Stage::NodeDeleted => "node_deleted",
            Stage::Leadership => "leadership",
        }
    }
}

impl Error {
    /// Every (`stage`, `kind`) an error is counted under.
    pub const LABELS: &'static [(Stage, &'static str)] = &[
        (Stage::Read, "kube"),
        (Stage::WriteStatus, "kube"),
        (Stage::Act, "kube"),
        (Stage::Act, "invalid_request"),
        (Stage::PolicyStatus, "kube"),
        (Stage::NodeDeleted, "kube"),
        (Stage::Leadership, "not_leader"),
    ];

    /// A short, stable label for metrics and logs: what went wrong.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::InvalidRequest { .. } => "invalid_request",
            Error::NotLeader => "not_leader",
            _ => "kube",
        }
    }

    pub fn stage(&self) -> Stage {
        match self {
            Error::Read { .. } => Stage::Read,
            Error::WriteStatus { .. } => Stage::WriteStatus,
            Error::Act { .. } | Error::InvalidRequest { .. } => Stage::Act,
            Error::PolicyStatus { .. } => Stage::PolicyStatus,
            Error::NodeDeleted { .. } => Stage::NodeDeleted,
            Error::NotLeader => Stage::Leadership,
        }
    }

    /// The API server's answer, where it refused or failed.
    pub fn api(&self) -> Option<&kube::Error> {
        match self {
            Error::Read { source, .. }
            | Error::WriteStatus { source, .. }
            | Error::Act { source, .. }
            | Error::PolicyStatus { source, .. }
            | Error::NodeDeleted { source, .. } => Some(source),
            Error::InvalidRequest { .. } | Error::NotLeader => None,
        }
    }

    /// The API status code, where the API server answered with one.
    pub fn code(&self) -> Option<u16> {
        match self.api()? {
            kube::Error::Api(s) => Some(s.code),
            _ => None,
        }
    }

    /// `Error::Read` for `node`, for `map_err`.
    pub fn read(node: &str) -> impl FnOnce(kube::Error) -> Error + '_ {
        move |source| Error::Read {
            node: node.to_owned(),
            source,
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
        match (self, self.code()) {
            (Error::NotLeader, _) => Retry::Standby,
            (Error::InvalidRequest { .. }, _) => Retry::OnChange,
            (_, Some(409)) => Retry::Soon,
            (_, Some(400 | 422)) => Retry::OnChange,
            _ => Retry::BackOff,
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

/// What a controller reconciles: each counts its own failures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Subject {
    Node,
    Policy,
}

impl Subject {
    pub fn as_str(self) -> &'static str {
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
    pub fn one_more(&self, subject: Subject, name: &str) -> u32 {
        let mut all = self.lock();
        let n = all.entry((subject, name.to_owned())).or_default();
        *n = n.saturating_add(1);
        *n
    }

    /// A reconcile of `name` succeeded: its back-off starts over.
    pub fn forget(&self, subject: Subject, name: &str) {
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

    fn lock(&self) -> MutexGuard<'_, HashMap<(Subject, String), u32>> {
        self.0.lock()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api(code: u16) -> Error {
        Error::WriteStatus {
            node: "gpu-node-1".into(),
            source: kube::Error::Api(
                kube::core::Status::failure("test", "Test")
                    .with_code(code)
                    .boxed(),
            ),
        }
    }

    #[test]
    fn each_kind_of_error_is_tried_again_in_its_own_time() {
        assert_eq!(api(409).retry().after(1), Some(Duration::from_secs(1)));
        assert_eq!(api(422).retry().after(1), None);
        let invalid = Error::InvalidRequest {
            node: "gpu-node-1".into(),
            action: ActionKind::RequestReset,
            why: "x".into(),
        };
        assert_eq!(invalid.retry().after(3), None);
        assert_eq!(api(500).retry().after(1), Some(Duration::from_secs(2)));
        assert_eq!(api(503).retry().after(3), Some(Duration::from_secs(8)));
        assert_eq!(api(429).retry().after(50), Some(Duration::from_secs(60)));
        assert_eq!(
            Error::NotLeader.retry().after(9),
            Some(Duration::from_secs(5))
        );
    }

    #[test]
    fn an_error_names_its_stage_and_subject() {
        let e = api(500);
        assert_eq!(e.stage(), Stage::WriteStatus);
        assert_eq!(e.metric_label(), "kube");
        assert!(
            e.to_string()
                .starts_with("writing the status of node gpu-node-1: "),
            "{e}"
        );
        for error in [&e, &Error::NotLeader] {
            let labels = (error.stage(), error.metric_label());
            assert!(
                Error::LABELS.contains(&labels),
                "{labels:?} not pre-registered"
            );
        }
    }

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
