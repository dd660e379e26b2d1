//! What this process remembers of each node between its reconciles, in
//! one place, and forgotten in one place once the node is gone: its latest
//! decision until the watch shows it, the pods last seen holding its GPUs,
//! and when its report (or its lack of one) was first seen as it is.

use std::collections::HashMap;

use gpuhealth_api::node_health::GpuNodeHealthStatus;
use k8s_openapi::jiff::Timestamp;
use parking_lot::{Mutex, MutexGuard};

/// What a node's last reconcile saw of the pods holding its GPUs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum HoldersSeen {
    /// Their hash (`observe::holders_hash`), not their names: it is kept
    /// for every node of the fleet.
    Holders(u64),
    /// The pods were not listed (a quarantine decided on the report alone):
    /// the next reconcile lists them, for their readiness gates.
    GatesPending,
}

/// A node's report as last seen: its `observedAt` (None: no report), and
/// when this process first saw it so, by its own clock.
#[derive(Clone, Copy, Debug)]
struct ReportSeen {
    observed_at: Option<Timestamp>,
    first_seen: Timestamp,
}

#[derive(Default)]
pub struct NodeMemory {
    /// Decisions that may start a remediation are made one at a time, each
    /// seeing the statuses the ones before it wrote: reconciles of different
    /// nodes run concurrently, and two nodes deciding at once on the same
    /// budget could both start. Held only to compute, never across I/O, so a
    /// plain mutex: tokio's handed the lock over through the scheduler's run
    /// queue, and under load each waiter waited for the whole queue (the
    /// benchmark saw 0.4 s mean waits for 0.7 ms decisions).
    decisions: Mutex<HashMap<String, GpuNodeHealthStatus>>,
    holders: Mutex<HashMap<String, HoldersSeen>>,
    reports: Mutex<HashMap<String, ReportSeen>>,
}

impl NodeMemory {
    /// This process's latest decision for each node it decided on, until
    /// the watch shows it.
    pub fn lock_decisions(&self) -> MutexGuard<'_, HashMap<String, GpuNodeHealthStatus>> {
        self.decisions.lock()
    }

    pub fn holders_seen(&self, node: &str) -> Option<HoldersSeen> {
        self.holders.lock().get(node).copied()
    }

    pub fn remember_holders(&self, node: &str, seen: HoldersSeen) {
        self.holders.lock().insert(node.to_owned(), seen);
    }

    /// When this process first saw `node`'s report observed at
    /// `observed_at`, by its own clock: how old a report is, judged on one
    /// clock whatever the agent's says. With None, when it first saw the
    /// node managed with no report: how long one has been awaited.
    pub fn report_first_seen(&self, node: &str, observed_at: Option<Timestamp>) -> Timestamp {
        let mut reports = self.reports.lock();
        let seen = reports.entry(node.to_owned()).or_insert(ReportSeen {
            observed_at,
            first_seen: Timestamp::now(),
        });
        if seen.observed_at != observed_at {
            *seen = ReportSeen {
                observed_at,
                first_seen: Timestamp::now(),
            };
        }
        seen.first_seen
    }

    /// Forgets what was seen of `node`'s report, now that no policy
    /// manages it: selected again, it awaits a report afresh.
    pub fn forget_report(&self, node: &str) {
        self.reports.lock().remove(node);
    }

    /// Forgets every node `still_there` does not name: a deleted node's
    /// decision (its record, if any, is then the watch's), holders and
    /// report.
    pub fn forget_gone(&self, still_there: impl Fn(&str) -> bool) {
        self.decisions.lock().retain(|n, _| still_there(n));
        self.holders.lock().retain(|n, _| still_there(n));
        self.reports.lock().retain(|n, _| still_there(n));
    }

    /// How many nodes each kind of memory holds: (decisions, holders,
    /// reports).
    #[cfg(test)]
    pub fn sizes(&self) -> (usize, usize, usize) {
        (
            self.decisions.lock().len(),
            self.holders.lock().len(),
            self.reports.lock().len(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_gone_is_forgotten_and_the_others_kept() {
        let memory = NodeMemory::default();
        for node in ["gpu-1", "gpu-2"] {
            memory
                .lock_decisions()
                .insert(node.into(), GpuNodeHealthStatus::default());
            memory.remember_holders(node, HoldersSeen::Holders(7));
            memory.report_first_seen(node, Some(Timestamp::UNIX_EPOCH));
        }
        memory.forget_gone(|n| n == "gpu-2");
        assert_eq!(memory.sizes(), (1, 1, 1));
        assert_eq!(memory.holders_seen("gpu-2"), Some(HoldersSeen::Holders(7)));
        assert_eq!(memory.holders_seen("gpu-1"), None);
    }

    #[test]
    fn a_report_is_dated_when_it_is_first_seen_as_it_is() {
        let memory = NodeMemory::default();
        let observed: Timestamp = "2026-12-05T12:00:00Z".parse().expect("time");
        let first = memory.report_first_seen("gpu-1", Some(observed));
        assert_eq!(memory.report_first_seen("gpu-1", Some(observed)), first);
        let newer = observed + k8s_openapi::jiff::SignedDuration::from_secs(60);
        assert!(memory.report_first_seen("gpu-1", Some(newer)) >= first);
    }

    #[test]
    fn no_report_is_awaited_from_when_it_was_first_seen_so_until_it_is_forgotten() {
        let memory = NodeMemory::default();
        let first = memory.report_first_seen("gpu-1", None);
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert_eq!(memory.report_first_seen("gpu-1", None), first);
        // A report, then none again: awaited from then.
        let observed: Timestamp = "2026-12-05T12:00:00Z".parse().expect("time");
        memory.report_first_seen("gpu-1", Some(observed));
        let again = memory.report_first_seen("gpu-1", None);
        assert!(again > first);
        // No longer managed: selected again, awaited afresh.
        memory.forget_report("gpu-1");
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert!(memory.report_first_seen("gpu-1", None) > again);
    }
}
