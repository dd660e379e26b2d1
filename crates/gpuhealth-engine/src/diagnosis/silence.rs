//! A node with no GPU report at all: no report is no signal, so a node
//! whose agent never started there (crash-looping, no runtime class, no
//! image for its architecture, a DaemonSet that does not select it) would
//! look healthy forever. Once a report has been awaited for the policy's
//! `staleAfter`, the node is said to have none; like a stale report, that
//! starts nothing.

use gpuhealth_api::{
    node_health::{ReportProblem, ReportProblemKind},
    policy::Detection,
};
use k8s_openapi::jiff::Timestamp;

use super::{Diagnosis, Evidence, after};

/// Says the node has no report once its grace is over, or when to look
/// again if it is not.
pub(super) fn no_report(
    now: Timestamp,
    detection: &Detection,
    evidence: &Evidence<'_>,
    d: &mut Diagnosis,
) {
    let Some(since) = evidence.report_awaited_since else {
        return;
    };
    let stale_after = detection.gpu_report.stale_after;
    let due = after(since, stale_after.as_std());
    if evidence.report_missing_before || due <= now {
        // No instant in the message: it is the finding's identity, and a
        // restarted operator awaits from an instant of its own.
        d.report_problem = Some(ReportProblem {
            kind: ReportProblemKind::Missing,
            message: format!(
                "no GPU report (gpuhealth.io/gpus) within detection.gpuReport.staleAfter ({stale_after}) of the node being selected: is gpuhealth's agent running there (its DaemonSet's nodeSelector, the runtime class, an image for the node's architecture)?"
            ),
        });
    } else {
        d.stale_at = Some(due);
    }
}

#[cfg(test)]
mod tests {
    use gpuhealth_api::{contract::ContractError, contract::GpuReport};

    use super::super::{
        diagnose,
        tests::{detection, incident_report, ts},
    };
    use super::*;

    fn evidence<'a>(
        report: Option<&'a Result<GpuReport, ContractError>>,
        awaited_since: Option<Timestamp>,
        missing_before: bool,
    ) -> Evidence<'a> {
        Evidence {
            conditions: &[],
            report,
            report_refreshed_at: None,
            report_awaited_since: awaited_since,
            report_missing_before: missing_before,
            xids_since: None,
            devices: &[],
            unhealthy: &[],
            gang_window: None,
        }
    }

    /// Awaited since 08:00; the default `staleAfter` is 15 minutes.
    const SINCE: &str = "2026-05-29T08:00:00Z";

    #[test]
    fn within_its_grace_a_node_without_a_report_is_looked_at_again_when_it_ends() {
        let d = diagnose(
            ts("2026-05-29T08:14:59Z"),
            &detection(),
            &evidence(None, Some(ts(SINCE)), false),
        );
        assert_eq!(d.report_problem, None);
        assert_eq!(d.stale_at, Some(ts("2026-05-29T08:15:00Z")));
        assert!(d.is_clear(), "{d:?}");
    }

    #[test]
    fn past_its_grace_a_node_without_a_report_is_said_to_have_none_and_nothing_more() {
        let d = diagnose(
            ts("2026-05-29T08:15:00Z"),
            &detection(),
            &evidence(None, Some(ts(SINCE)), false),
        );
        let problem = d.report_problem.clone().expect("said");
        assert_eq!(problem.kind, ReportProblemKind::Missing);
        assert!(problem.message.contains("15m"), "{}", problem.message);
        assert_eq!(d.stale_at, None, "nothing more to wait for");
        assert!(d.is_clear(), "no signal: {d:?}");
        // The message is the same whenever it is said.
        let later = diagnose(
            ts("2026-05-29T09:00:00Z"),
            &detection(),
            &evidence(None, Some(ts("2026-05-29T08:30:00Z")), false),
        );
        assert_eq!(later.report_problem, Some(problem));
    }

    #[test]
    fn what_the_status_already_says_holds_through_a_new_grace() {
        let d = diagnose(
            ts("2026-05-29T08:01:00Z"),
            &detection(),
            &evidence(None, Some(ts(SINCE)), true),
        );
        assert_eq!(
            d.report_problem.map(|p| p.kind),
            Some(ReportProblemKind::Missing)
        );
    }

    #[test]
    fn a_report_or_a_policy_that_reads_none_is_no_silence() {
        let report = incident_report();
        let now = ts("2026-05-29T09:00:00Z");
        // A report, however old the wait for one: its own age is judged.
        let d = diagnose(
            now,
            &detection(),
            &evidence(Some(&report), Some(ts(SINCE)), true),
        );
        assert_ne!(
            d.report_problem.map(|p| p.kind),
            Some(ReportProblemKind::Missing)
        );
        // Nothing awaited (the operator has not said since when).
        let d = diagnose(now, &detection(), &evidence(None, None, false));
        assert_eq!((d.report_problem, d.stale_at), (None, None));
        // A policy that does not read the report awaits none.
        let mut off = detection();
        off.gpu_report.enabled = false;
        let d = diagnose(now, &off, &evidence(None, Some(ts(SINCE)), true));
        assert_eq!((d.report_problem, d.stale_at), (None, None));
    }
}
