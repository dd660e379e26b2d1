//! Is a workload serving, and if not, why? Joins what one pod's status and
//! the kubelet's Events show (restart causes, cold starts) into a verdict
//! for the workload: the incident's second half was a pod that the GPU
//! reset had nothing more to do with, killed over and over by a startup
//! probe shorter than its cold start.

use std::{collections::BTreeMap, time::Duration};

use gpuhealth_api::{contract::XidEvent, vocabulary::PodKey};
use k8s_openapi::{
    api::core::v1::{Event, Pod, Probe},
    jiff::Timestamp,
};

use crate::{
    probes::{ColdStart, ProbeTiming, StartBound, Verdict, judge},
    restarts::{KubeletEvent, RestartCause, Termination, classify},
};

/// One container of a pod, as its spec and status show it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerObservation {
    pub name: String,
    pub startup: Option<ProbeTiming>,
    pub liveness: Option<ProbeTiming>,
    pub restarts: u32,
    /// When its current run started, if it is running.
    pub running_since: Option<Timestamp>,
    /// Why it is waiting, if it is (`CrashLoopBackOff`, `ContainerCreating`).
    pub waiting: Option<String>,
    pub last: Option<Termination>,
}

/// One pod of a workload, with the kubelet's Events about it and the Xids
/// of the GPUs it holds.
#[derive(Clone, Debug, PartialEq)]
pub struct PodObservation {
    pub pod: PodKey,
    /// Its controller, as `Kind/namespace/name`.
    pub workload: Option<String>,
    pub phase: String,
    pub ready: bool,
    /// When it last became Ready, if it is.
    pub ready_since: Option<Timestamp>,
    pub containers: Vec<ContainerObservation>,
    pub events: Vec<KubeletEvent>,
    pub xids: Vec<XidEvent>,
}

impl PodObservation {
    /// Whether it is serving, or done: a finished Job pod is not a failure.
    pub fn is_fine(&self) -> bool {
        self.ready || self.phase == "Succeeded"
    }

    /// Why each container that restarted last restarted.
    pub fn restart_causes(&self) -> Vec<(&ContainerObservation, RestartCause)> {
        self.containers
            .iter()
            .filter(|c| c.restarts > 0)
            .filter_map(|c| {
                let last = c.last.as_ref()?;
                Some((c, classify(&c.name, last, &self.events, &self.xids)))
            })
            .collect()
    }

    /// What this pod showed about `container`'s cold start.
    pub fn cold_starts(&self, container: &ContainerObservation) -> Vec<ColdStart> {
        let mut seen = Vec::new();
        if let (true, Some(started), Some(ready)) =
            (self.ready, container.running_since, self.ready_since)
            && ready >= started
        {
            let took = seconds(ready.duration_since(started));
            // The startup probe gates readiness and first runs after its delay.
            let earliest = container.startup.map_or(Duration::ZERO, |p| {
                Duration::from_secs(p.initial_delay_seconds.into())
            });
            seen.push(if took < earliest {
                ColdStart::BeforeProbe(took)
            } else {
                ColdStart::Ready(took)
            });
        }
        if let Some(last) = &container.last
            && let Some(started) = last.started_at
            && self.killed_while_starting(container, last)
        {
            seen.push(ColdStart::KilledAfter(seconds(
                last.finished_at.duration_since(started),
            )));
        }
        seen
    }

    /// Whether the last run was cut short by the probe that bounds the
    /// start: a startup-probe kill always is; a liveness-probe kill only
    /// without a startup probe and as soon as the window allowed (a pod
    /// that served for a while and then hung says nothing about its start).
    fn killed_while_starting(&self, container: &ContainerObservation, last: &Termination) -> bool {
        match classify(&container.name, last, &self.events, &self.xids) {
            RestartCause::StartupProbe => true,
            RestartCause::LivenessProbe => match (container.startup, container.liveness) {
                (None, Some(liveness)) => last.started_at.is_some_and(|started| {
                    let ran = seconds(last.finished_at.duration_since(started));
                    let period = u64::from(liveness.period_seconds.max(1));
                    ran <= liveness.window() + Duration::from_secs(period)
                }),
                _ => false,
            },
            _ => false,
        }
    }
}

fn seconds(d: k8s_openapi::jiff::SignedDuration) -> Duration {
    Duration::from_secs(u64::try_from(d.as_secs()).unwrap_or(0))
}

/// A workload being watched, with its pods wherever they run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct WorkloadView {
    /// `Kind/namespace/name` of the pods' controller.
    pub name: String,
    pub pods: Vec<PodObservation>,
}

/// One container of a workload: the probe that bounds its start, and the
/// verdict on it from every pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerVerdict {
    pub container: String,
    pub bound: StartBound,
    pub observed: Vec<ColdStart>,
    pub verdict: Verdict,
}

/// A restart seen on one of the workload's pods.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Restart {
    pub pod: PodKey,
    pub container: String,
    pub count: u32,
    pub cause: RestartCause,
}

/// The workload as a whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assessment {
    pub pods: usize,
    pub fine: usize,
    pub not_ready: Vec<PodKey>,
    pub restarts: Vec<Restart>,
    pub containers: Vec<ContainerVerdict>,
}

impl Assessment {
    /// Every pod is serving (or done), and there is at least one.
    pub fn recovered(&self) -> bool {
        self.pods > 0 && self.fine == self.pods
    }

    /// Containers whose startup window is shorter than their cold start.
    pub fn too_short(&self) -> impl Iterator<Item = &ContainerVerdict> {
        self.containers
            .iter()
            .filter(|c| matches!(c.verdict, Verdict::WindowTooShort { .. }))
    }

    /// Why the workload is not serving, in plain words; empty when it is.
    pub fn why_not(&self) -> String {
        if self.pods == 0 {
            return "no pods: its controller has not recreated any (deleted, scaled to zero, or unable to create them)".into();
        }
        if self.recovered() {
            return String::new();
        }
        let mut parts = vec![format!(
            "{} of {} pod(s) Ready ({} not: {})",
            self.fine,
            self.pods,
            self.not_ready.len(),
            self.not_ready
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        )];
        for r in &self.restarts {
            parts.push(format!(
                "{} container {} restarted {} time(s), last {}",
                r.pod,
                r.container,
                r.count,
                cause_text(&r.cause)
            ));
        }
        for c in self.too_short() {
            parts.push(verdict_text(&c.container, &c.verdict));
        }
        if self.restarts.is_empty() {
            parts.push("no restarts recorded: look at scheduling, image pulls and readiness probes (kubectl describe pod)".into());
        }
        parts.join("; ")
    }
}

/// The verdict on a workload from its pods (all from one template).
pub fn assess(pods: &[PodObservation]) -> Assessment {
    let mut names: Vec<&ContainerObservation> = Vec::new();
    for c in pods.iter().flat_map(|p| &p.containers) {
        if !names.iter().any(|n| n.name == c.name) {
            names.push(c);
        }
    }
    let containers = names
        .into_iter()
        .map(|c| {
            let bound = StartBound::of(c.startup, c.liveness);
            let observed: Vec<ColdStart> = pods
                .iter()
                .flat_map(|p| {
                    p.containers
                        .iter()
                        .filter(|pc| pc.name == c.name)
                        .flat_map(|pc| p.cold_starts(pc))
                        .collect::<Vec<_>>()
                })
                .collect();
            ContainerVerdict {
                container: c.name.clone(),
                bound,
                verdict: judge(&bound, &observed),
                observed,
            }
        })
        .collect();
    let restarts = pods
        .iter()
        .flat_map(|p| {
            p.restart_causes()
                .into_iter()
                .map(|(c, cause)| Restart {
                    pod: p.pod.clone(),
                    container: c.name.clone(),
                    count: c.restarts,
                    cause,
                })
                .collect::<Vec<_>>()
        })
        .collect();
    Assessment {
        pods: pods.len(),
        fine: pods.iter().filter(|p| p.is_fine()).count(),
        not_ready: pods
            .iter()
            .filter(|p| !p.is_fine())
            .map(|p| p.pod.clone())
            .collect(),
        restarts,
        containers,
    }
}

/// A restart cause in words.
pub fn cause_text(cause: &RestartCause) -> String {
    match cause {
        RestartCause::GpuError { code } => {
            format!("after Xid {code} on its GPU: a GPU error, not the workload")
        }
        RestartCause::OomKilled => "OOM-killed: raise its memory limit".into(),
        RestartCause::StartupProbe => {
            "killed by its startup probe before it started: a probe problem, not a GPU failure"
                .into()
        }
        RestartCause::LivenessProbe => "killed by its liveness probe".into(),
        RestartCause::ExitedWithError { exit_code } => {
            format!("exited with code {exit_code} (kubectl logs --previous)")
        }
        RestartCause::Completed => "exited with code 0".into(),
    }
}

/// A verdict in words, with the fix when there is one.
pub fn verdict_text(container: &str, verdict: &Verdict) -> String {
    match verdict {
        Verdict::Ok {
            window: Some(w),
            slowest,
        } => format!(
            "container {container}: startup window {}s covers the slowest observed cold start ({}s)",
            w.as_secs(),
            slowest.as_secs()
        ),
        Verdict::Ok {
            window: None,
            slowest,
        } => format!(
            "container {container}: no probe bounds its start; slowest observed cold start {}s",
            slowest.as_secs()
        ),
        Verdict::WindowTooShort {
            window,
            needs_at_least,
            recommended,
        } => format!(
            "container {container}: startup window {}s is shorter than its cold start (at least {}s); set startupProbe.failureThreshold to {} (window {}s)",
            window.as_secs(),
            needs_at_least.as_secs(),
            recommended.failure_threshold,
            recommended.window().as_secs()
        ),
        Verdict::Unknown { missing } => format!("container {container}: unknown: {missing}"),
    }
}

/// A probe's timing with Kubernetes' defaults for what it leaves unset.
pub fn probe_timing(probe: &Probe) -> ProbeTiming {
    let d = ProbeTiming::default();
    let get = |v: Option<i32>, default: u32| v.map_or(default, |v| u32::try_from(v).unwrap_or(0));
    ProbeTiming {
        initial_delay_seconds: get(probe.initial_delay_seconds, d.initial_delay_seconds),
        period_seconds: get(probe.period_seconds, d.period_seconds),
        timeout_seconds: get(probe.timeout_seconds, d.timeout_seconds),
        failure_threshold: get(probe.failure_threshold, d.failure_threshold),
    }
}

/// A pod's controller, as `Kind/namespace/name`.
pub fn controller_of(pod: &Pod) -> Option<String> {
    let owner = pod
        .metadata
        .owner_references
        .as_ref()?
        .iter()
        .find(|o| o.controller == Some(true))?;
    let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
    Some(format!("{}/{namespace}/{}", owner.kind, owner.name))
}

/// The kubelet's Events about a pod, as the classifier reads them.
pub fn kubelet_events(events: &[Event]) -> Vec<KubeletEvent> {
    events
        .iter()
        .filter_map(|e| {
            let at = e
                .last_timestamp
                .as_ref()
                .map(|t| t.0)
                .or(e.event_time.as_ref().map(|t| t.0))
                .or(e.first_timestamp.as_ref().map(|t| t.0))?;
            Some(KubeletEvent {
                reason: e.reason.clone().unwrap_or_default(),
                message: e.message.clone().unwrap_or_default(),
                at,
            })
        })
        .collect()
}

/// What a pod's spec and status show, with the kubelet's Events about it
/// and the Xids of the GPUs it holds.
pub fn observe(pod: &Pod, events: &[Event], xids: Vec<XidEvent>) -> PodObservation {
    let namespace = pod.metadata.namespace.as_deref().unwrap_or_default();
    let name = pod.metadata.name.as_deref().unwrap_or_default();
    let status = pod.status.as_ref();
    let ready_condition = status
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
    let ready = ready_condition.is_some_and(|c| c.status == "True");
    let statuses: BTreeMap<&str, _> = status
        .and_then(|s| s.container_statuses.as_ref())
        .map(|cs| cs.iter().map(|c| (c.name.as_str(), c)).collect())
        .unwrap_or_default();
    let containers = pod
        .spec
        .as_ref()
        .map(|s| s.containers.as_slice())
        .unwrap_or_default()
        .iter()
        .map(|c| {
            let st = statuses.get(c.name.as_str());
            let state = st.and_then(|s| s.state.as_ref());
            let last = st
                .and_then(|s| s.last_state.as_ref())
                .and_then(|s| s.terminated.as_ref())
                .and_then(|t| {
                    Some(Termination {
                        reason: t.reason.clone().unwrap_or_default(),
                        exit_code: t.exit_code,
                        started_at: t.started_at.as_ref().map(|t| t.0),
                        finished_at: t.finished_at.as_ref()?.0,
                    })
                });
            ContainerObservation {
                name: c.name.clone(),
                startup: c.startup_probe.as_ref().map(probe_timing),
                liveness: c.liveness_probe.as_ref().map(probe_timing),
                restarts: st.map_or(0, |s| u32::try_from(s.restart_count).unwrap_or(0)),
                running_since: state
                    .and_then(|s| s.running.as_ref())
                    .and_then(|r| r.started_at.as_ref())
                    .map(|t| t.0),
                waiting: state
                    .and_then(|s| s.waiting.as_ref())
                    .and_then(|w| w.reason.clone()),
                last,
            }
        })
        .collect();
    PodObservation {
        pod: PodKey::new(namespace, name),
        workload: controller_of(pod),
        phase: status.and_then(|s| s.phase.clone()).unwrap_or_default(),
        ready,
        ready_since: ready_condition
            .filter(|_| ready)
            .and_then(|c| c.last_transition_time.as_ref())
            .map(|t| t.0),
        containers,
        events: kubelet_events(events),
        xids,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> Timestamp {
        s.parse().expect("timestamp")
    }

    /// The incident's vLLM probe: 330 s of startup window.
    const VLLM: ProbeTiming = ProbeTiming {
        initial_delay_seconds: 30,
        period_seconds: 10,
        timeout_seconds: 5,
        failure_threshold: 30,
    };

    fn vllm(restarts: u32, last: Option<Termination>) -> ContainerObservation {
        ContainerObservation {
            name: "vllm".into(),
            startup: Some(VLLM),
            liveness: None,
            restarts,
            running_since: Some(t("2026-05-29T09:05:41Z")),
            waiting: None,
            last,
        }
    }

    fn looping_pod() -> PodObservation {
        PodObservation {
            pod: PodKey::new("ml", "vllm-1"),
            workload: Some("ReplicaSet/ml/vllm-7d9f6".into()),
            phase: "Running".into(),
            ready: false,
            ready_since: None,
            containers: vec![vllm(
                2,
                Some(Termination {
                    reason: "Error".into(),
                    exit_code: 137,
                    started_at: Some(t("2026-05-29T09:00:00Z")),
                    finished_at: t("2026-05-29T09:05:31Z"),
                }),
            )],
            events: vec![KubeletEvent {
                reason: "Killing".into(),
                message: "Container vllm failed startup probe, will be restarted".into(),
                at: t("2026-05-29T09:05:30Z"),
            }],
            xids: Vec::new(),
        }
    }

    #[test]
    fn a_startup_probe_loop_is_a_window_too_short_with_its_fix() {
        let a = assess(&[looping_pod()]);
        assert!(!a.recovered());
        assert_eq!(a.restarts[0].cause, RestartCause::StartupProbe);
        let too_short: Vec<_> = a.too_short().collect();
        assert_eq!(too_short.len(), 1);
        let why = a.why_not();
        assert!(why.contains("0 of 1 pod(s) Ready"), "{why}");
        assert!(why.contains("killed by its startup probe"), "{why}");
        assert!(
            why.contains("startup window 330s is shorter than its cold start (at least 331s)"),
            "{why}"
        );
    }

    #[test]
    fn a_ready_pod_gives_its_cold_start_beside_the_kill_before_it() {
        let mut pod = looping_pod();
        pod.ready = true;
        pod.ready_since = Some(t("2026-05-29T09:09:01Z"));
        let c = pod.containers[0].clone();
        assert_eq!(
            pod.cold_starts(&c),
            vec![
                ColdStart::Ready(Duration::from_secs(200)),
                ColdStart::KilledAfter(Duration::from_secs(331))
            ]
        );
    }

    #[test]
    fn a_ready_before_the_startup_probe_could_run_is_not_a_cold_start() {
        let mut pod = looping_pod();
        pod.ready = true;
        // Ready the instant it ran, as KWOK makes it, under a 600 s delay.
        pod.ready_since = pod.containers[0].running_since;
        pod.containers[0].last = None;
        pod.containers[0].startup = Some(ProbeTiming {
            initial_delay_seconds: 600,
            ..VLLM
        });
        let c = pod.containers[0].clone();
        assert_eq!(
            pod.cold_starts(&c),
            vec![ColdStart::BeforeProbe(Duration::ZERO)]
        );
        let a = assess(&[pod]);
        assert!(
            a.containers
                .iter()
                .all(|c| matches!(c.verdict, crate::probes::Verdict::Unknown { .. })),
            "never Ok on no real start: {:?}",
            a.containers
        );
    }

    #[test]
    fn a_liveness_kill_counts_only_at_the_end_of_the_start_window() {
        let liveness = ProbeTiming {
            initial_delay_seconds: 60,
            ..ProbeTiming::default()
        };
        let mut pod = looping_pod();
        pod.events[0].message = "Container vllm failed liveness probe, will be restarted".into();
        pod.containers[0].startup = None;
        pod.containers[0].liveness = Some(liveness);
        let mut c = pod.containers[0].clone();
        // Killed after 331 s against a 90 s window: it had run a while.
        assert_eq!(pod.cold_starts(&c), vec![]);
        // Killed after 91 s: as soon as the window allowed.
        if let Some(last) = &mut c.last {
            last.started_at = Some(t("2026-05-29T09:04:00Z"));
        }
        assert_eq!(
            pod.cold_starts(&c),
            vec![ColdStart::KilledAfter(Duration::from_secs(91))]
        );
    }

    #[test]
    fn no_pods_and_pending_pods_say_what_is_missing() {
        let none = assess(&[]);
        assert!(!none.recovered());
        assert!(none.why_not().starts_with("no pods"));
        let mut pending = looping_pod();
        pending.containers[0] = ContainerObservation {
            restarts: 0,
            last: None,
            running_since: None,
            waiting: Some("ContainerCreating".into()),
            ..pending.containers[0].clone()
        };
        pending.events.clear();
        let a = assess(&[pending]);
        assert!(matches!(
            &a.containers[0].verdict,
            Verdict::Unknown { missing } if missing.contains("no pod of the workload")
        ));
        assert!(
            a.why_not().contains("no restarts recorded"),
            "{}",
            a.why_not()
        );
    }

    #[test]
    fn probe_defaults_follow_kubernetes() {
        assert_eq!(probe_timing(&Probe::default()), ProbeTiming::default());
        let p = Probe {
            initial_delay_seconds: Some(30),
            failure_threshold: Some(30),
            ..Default::default()
        };
        assert_eq!(probe_timing(&p).window(), Duration::from_secs(330));
    }
}
