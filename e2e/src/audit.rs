//! Leadership judged from the API server's own audit log, not from any
//! replica's word: who held the Lease at each moment (the Lease writes that
//! succeeded, with the holder each left), and which replica made every
//! other write (each names itself in its User-Agent). A write by a replica
//! that did not hold the Lease when the API server received it is a
//! violation, whatever the replica believed.
//!
//! The local cluster writes the log when started with
//! `GPUHEALTH_CLUSTER_AUDIT=1` (`make chaos` does): every write at
//! `Metadata` level, Lease writes with the object (`e2e/cluster/cluster.sh`).

use std::path::{Path, PathBuf};

use k8s_openapi::jiff::Timestamp;
use serde::Deserialize;

use crate::invariants::Violation;

/// One line of the audit log, as much of it as the judge reads.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Line {
    stage: String,
    verb: String,
    #[serde(default)]
    user_agent: String,
    object_ref: Option<ObjectRef>,
    response_status: Option<Status>,
    request_received_timestamp: Timestamp,
    stage_timestamp: Timestamp,
    response_object: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ObjectRef {
    resource: Option<String>,
    namespace: Option<String>,
    name: Option<String>,
    subresource: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Status {
    code: Option<u16>,
}

const WRITES: [&str; 5] = ["create", "update", "patch", "delete", "deletecollection"];

/// Where the cluster behind `kubeconfig` writes its audit log: beside it.
pub fn log_beside(kubeconfig: &Path) -> PathBuf {
    kubeconfig.with_file_name("audit.log")
}

/// How many writes that succeeded the replicas whose names contain
/// `replicas` (a fleet's group) made, and each made while the replica did
/// not hold Lease `lease` (in namespace `default`), from audit log `text`.
pub fn writes_without_lease(text: &str, lease: &str, replicas: &str) -> (usize, Vec<Violation>) {
    let lines: Vec<Line> = text
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .filter(|l: &Line| l.stage == "ResponseComplete" && WRITES.contains(&l.verb.as_str()))
        .filter(|l| {
            l.response_status
                .as_ref()
                .and_then(|s| s.code)
                .is_some_and(|c| c < 300)
        })
        .collect();
    // The holder each successful write of the Lease left, when it landed.
    let mut holders: Vec<(Timestamp, String)> = lines
        .iter()
        .filter(|l| is_lease(l, lease))
        .map(|l| {
            let holder = l
                .response_object
                .as_ref()
                .and_then(|o| o.pointer("/spec/holderIdentity"))
                .and_then(|h| h.as_str())
                .unwrap_or_default();
            (l.stage_timestamp, holder.to_owned())
        })
        .collect();
    holders.sort_by_key(|(at, _)| *at);
    let mut violations = Vec::new();
    let mut judged = 0;
    for l in lines.iter().filter(|l| !is_lease(l, lease)) {
        let Some(replica) = replica_of(&l.user_agent).filter(|r| r.contains(replicas)) else {
            continue;
        };
        judged += 1;
        let at = l.request_received_timestamp;
        let holder = holders
            .iter()
            .take_while(|(when, _)| *when <= at)
            .last()
            .map(|(_, h)| h.as_str());
        if holder != Some(replica) {
            let what = l.object_ref.as_ref().map_or(String::new(), |o| {
                format!(
                    "{} {}{}{}",
                    l.verb,
                    o.resource.as_deref().unwrap_or_default(),
                    o.subresource
                        .as_deref()
                        .map_or(String::new(), |s| format!("/{s}")),
                    o.name.as_deref().map_or(String::new(), |n| format!(" {n}")),
                )
            });
            violations.push(Violation::WriteWithoutLease {
                replica: replica.to_owned(),
                holder: holder.unwrap_or("nobody").to_owned(),
                what,
                at: at.to_string(),
            });
        }
    }
    (judged, violations)
}

fn is_lease(l: &Line, lease: &str) -> bool {
    l.object_ref.as_ref().is_some_and(|o| {
        o.resource.as_deref() == Some("leases")
            && o.namespace.as_deref() == Some("default")
            && o.name.as_deref() == Some(lease)
    })
}

/// The replica a User-Agent names: `gpuhealth-operator/0.1.0 (name)`.
fn replica_of(user_agent: &str) -> Option<&str> {
    let rest = user_agent.strip_prefix("gpuhealth-operator/")?;
    let (_, name) = rest.split_once(" (")?;
    name.strip_suffix(')')
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One audit line: `who` wrote `resource` `name` at second `at`; for
    /// the Lease, leaving `holder`.
    fn line(who: &str, resource: &str, name: &str, at: u32, holder: Option<&str>) -> String {
        let response = holder.map_or(String::new(), |h| {
            format!(r#","responseObject":{{"spec":{{"holderIdentity":"{h}"}}}}"#)
        });
        format!(
            r#"{{"stage":"ResponseComplete","verb":"update","userAgent":"gpuhealth-operator/0.1.0 ({who})","objectRef":{{"resource":"{resource}","namespace":"default","name":"{name}"}},"responseStatus":{{"code":200}},"requestReceivedTimestamp":"2026-12-02T10:00:{at:02}.000000Z","stageTimestamp":"2026-12-02T10:00:{at:02}.001000Z"{response}}}"#
        )
    }

    #[test]
    fn writes_only_by_the_holder_of_the_moment_pass() {
        let log = [
            line("g-replica-1", "leases", "g-lease", 1, Some("g-replica-1")),
            line("g-replica-1", "nodes", "n1", 2, None),
            // The standby takes over; then only it writes.
            line("g-replica-2", "leases", "g-lease", 10, Some("g-replica-2")),
            line("g-replica-2", "pods", "p1", 11, None),
            // Another fleet's replica and another tool are not judged.
            line("h-replica-1", "nodes", "n9", 12, None),
        ]
        .join("\n");
        assert_eq!(writes_without_lease(&log, "g-lease", "g-"), (2, vec![]));
    }

    #[test]
    fn a_write_by_a_replica_that_lost_the_lease_or_never_had_it_is_caught() {
        let log = [
            line("g-replica-3", "nodes", "n0", 0, None),
            line("g-replica-1", "leases", "g-lease", 1, Some("g-replica-1")),
            line("g-replica-2", "leases", "g-lease", 10, Some("g-replica-2")),
            // The old leader's write arrives after the takeover.
            line("g-replica-1", "nodes", "n1", 11, None),
            "not json: a line cut short".to_owned(),
        ]
        .join("\n");
        assert_eq!(
            writes_without_lease(&log, "g-lease", "g-").1,
            [
                Violation::WriteWithoutLease {
                    replica: "g-replica-3".into(),
                    holder: "nobody".into(),
                    what: "update nodes n0".into(),
                    at: "2026-12-02T10:00:00Z".into(),
                },
                Violation::WriteWithoutLease {
                    replica: "g-replica-1".into(),
                    holder: "g-replica-2".into(),
                    what: "update nodes n1".into(),
                    at: "2026-12-02T10:00:11Z".into(),
                },
            ]
        );
    }
}
