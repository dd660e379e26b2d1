//! Why a container restarted, from what Kubernetes recorded: its last
//! termination, the kubelet's Events, and the Xids on the GPUs it holds.
//! A probe that kills a slow starter is a probe problem, not a GPU failure,
//! and must never be mistaken for one.

use gpuhealth_api::contract::XidEvent;
use k8s_openapi::jiff::{SignedDuration, Timestamp};

/// A container's last termination (`status.containerStatuses[].lastState.terminated`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Termination {
    pub reason: String,
    pub exit_code: i32,
    pub started_at: Option<Timestamp>,
    pub finished_at: Timestamp,
}

/// A kubelet Event about the pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KubeletEvent {
    pub reason: String,
    pub message: String,
    pub at: Timestamp,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RestartCause {
    /// An Xid on one of its GPUs while it ran: the GPU, not the workload.
    GpuError {
        code: u32,
    },
    OomKilled,
    /// Killed by its startup probe: it did not start within the window.
    StartupProbe,
    LivenessProbe,
    ExitedWithError {
        exit_code: i32,
    },
    Completed,
}

/// How close to the termination an Event or Xid must be to explain it.
const SLACK: SignedDuration = SignedDuration::from_secs(30);

/// Classifies the last restart of `container`. `xids` are those of the
/// GPUs it holds.
pub fn classify(
    container: &str,
    last: &Termination,
    events: &[KubeletEvent],
    xids: &[XidEvent],
) -> RestartCause {
    let from = last
        .started_at
        .unwrap_or_else(|| last.finished_at - SignedDuration::from_hours(1));
    let until = last.finished_at + SLACK;
    let during = |at: Timestamp| at >= from && at <= until;
    // The GPU first: a hung process is often what a probe then kills.
    if let Some(x) = xids.iter().rfind(|x| during(x.at.0)) {
        return RestartCause::GpuError { code: x.code };
    }
    if last.reason == "OOMKilled" {
        return RestartCause::OomKilled;
    }
    let killing = format!("Container {container} failed");
    let probe_kill = events
        .iter()
        .rfind(|e| e.reason == "Killing" && during(e.at) && e.message.starts_with(&killing));
    if let Some(e) = probe_kill {
        if e.message.contains("startup probe") {
            return RestartCause::StartupProbe;
        }
        if e.message.contains("liveness probe") {
            return RestartCause::LivenessProbe;
        }
    }
    match last.exit_code {
        0 => RestartCause::Completed,
        code => RestartCause::ExitedWithError { exit_code: code },
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;

    fn t(s: &str) -> Timestamp {
        s.parse().expect("timestamp")
    }

    /// The incident's second half: vLLM killed by its startup probe at 330 s.
    fn killed_at_330() -> (Termination, Vec<KubeletEvent>) {
        let last = Termination {
            reason: "Error".into(),
            exit_code: 137,
            started_at: Some(t("2026-05-29T09:00:00Z")),
            finished_at: t("2026-05-29T09:05:31Z"),
        };
        let events = vec![
            KubeletEvent {
                reason: "Unhealthy".into(),
                message: "Startup probe failed: Get \"http://10.0.0.7:8000/health\": dial tcp 10.0.0.7:8000: connect: connection refused".into(),
                at: t("2026-05-29T09:05:20Z"),
            },
            KubeletEvent {
                reason: "Killing".into(),
                message: "Container vllm failed startup probe, will be restarted".into(),
                at: t("2026-05-29T09:05:30Z"),
            },
        ];
        (last, events)
    }

    #[test]
    fn a_startup_probe_kill_after_a_reset_is_a_probe_problem() {
        let (last, events) = killed_at_330();
        // The Xid that led to the reset came before this run began.
        let old = [XidEvent::new(119, Time(t("2026-05-29T08:24:51Z")), "")];
        assert_eq!(
            classify("vllm", &last, &events, &old),
            RestartCause::StartupProbe
        );
    }

    #[test]
    fn an_xid_during_the_run_is_the_gpu() {
        let (last, events) = killed_at_330();
        let during = [XidEvent::new(79, Time(t("2026-05-29T09:03:00Z")), "")];
        assert_eq!(
            classify("vllm", &last, &events, &during),
            RestartCause::GpuError { code: 79 }
        );
    }

    #[test]
    fn liveness_oom_errors_and_completion() {
        let (mut last, mut events) = killed_at_330();
        events[1].message = "Container vllm failed liveness probe, will be restarted".into();
        assert_eq!(
            classify("vllm", &last, &events, &[]),
            RestartCause::LivenessProbe
        );
        // Another container's kill says nothing about this one.
        assert_eq!(
            classify("sidecar", &last, &events, &[]),
            RestartCause::ExitedWithError { exit_code: 137 }
        );
        last.reason = "OOMKilled".into();
        assert_eq!(classify("vllm", &last, &[], &[]), RestartCause::OomKilled);
        last.reason = "Error".into();
        last.exit_code = 1;
        assert_eq!(
            classify("vllm", &last, &[], &[]),
            RestartCause::ExitedWithError { exit_code: 1 }
        );
        last.exit_code = 0;
        last.reason = "Completed".into();
        assert_eq!(classify("vllm", &last, &[], &[]), RestartCause::Completed);
    }

    #[test]
    fn an_event_from_an_earlier_run_does_not_explain_this_one() {
        let (mut last, events) = killed_at_330();
        last.started_at = Some(t("2026-05-29T09:10:00Z"));
        last.finished_at = t("2026-05-29T09:12:00Z");
        assert_eq!(
            classify("vllm", &last, &events, &[]),
            RestartCause::ExitedWithError { exit_code: 137 }
        );
    }
}
