//! Probe-window analysis: does a container's startup window cover how long
//! the workload actually takes to start? The incident's second half was a
//! vLLM pod killed over and over by a startup probe whose window was shorter
//! than its 600–800 s cold start: a probe problem, not a GPU one.

use std::time::Duration;

/// A probe's timing, as in the pod spec, with Kubernetes' defaults.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeTiming {
    pub initial_delay_seconds: u32,
    pub period_seconds: u32,
    pub timeout_seconds: u32,
    pub failure_threshold: u32,
}

impl Default for ProbeTiming {
    /// Kubernetes' defaults for a probe that sets none of these.
    fn default() -> Self {
        ProbeTiming {
            initial_delay_seconds: 0,
            period_seconds: 10,
            timeout_seconds: 1,
            failure_threshold: 3,
        }
    }
}

impl ProbeTiming {
    /// How long the probe can fail before the kubelet kills the container:
    /// each attempt takes at least its period, and a slow one its timeout.
    pub fn window(&self) -> Duration {
        let attempt = u64::from(self.period_seconds.max(self.timeout_seconds).max(1));
        Duration::from_secs(
            u64::from(self.initial_delay_seconds)
                + u64::from(self.failure_threshold.max(1)) * attempt,
        )
    }
}

/// Which probe bounds a container's start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StartBound {
    /// The startup probe: liveness and readiness wait until it succeeds.
    Startup(ProbeTiming),
    /// No startup probe: the liveness probe runs from the start and kills.
    Liveness(ProbeTiming),
    /// Neither: nothing kills a container for starting slowly.
    Unbounded,
}

impl StartBound {
    pub fn of(startup: Option<ProbeTiming>, liveness: Option<ProbeTiming>) -> StartBound {
        match (startup, liveness) {
            (Some(s), _) => StartBound::Startup(s),
            (None, Some(l)) => StartBound::Liveness(l),
            (None, None) => StartBound::Unbounded,
        }
    }

    /// The probe that can kill a starting container, if any.
    pub fn probe(&self) -> Option<ProbeTiming> {
        match self {
            StartBound::Startup(p) | StartBound::Liveness(p) => Some(*p),
            StartBound::Unbounded => None,
        }
    }

    pub fn window(&self) -> Option<Duration> {
        self.probe().map(|p| p.window())
    }
}

/// What one pod of the workload showed about its cold start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ColdStart {
    /// From the container's start to the pod's `Ready`.
    Ready(Duration),
    /// Killed by its startup (or liveness) probe this long after starting,
    /// never Ready: the cold start is longer than this.
    KilledAfter(Duration),
    /// Ready this long after starting, sooner than its startup probe's
    /// `initialDelaySeconds`: no kubelet can produce that (the startup
    /// probe gates readiness and first runs after its delay), only a
    /// simulated node can. Shown, never taken as a cold start.
    BeforeProbe(Duration),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Ok {
        window: Option<Duration>,
        slowest: Duration,
    },
    WindowTooShort {
        window: Duration,
        /// The slowest cold start seen, or a lower bound when no pod got
        /// that far.
        needs_at_least: Duration,
        recommended: ProbeTiming,
    },
    Unknown {
        missing: String,
    },
}

/// How much longer than the slowest observed cold start a recommended
/// window is: cold starts vary with cache state and GPU clocks.
pub const MARGIN_PERCENT: u64 = 50;

/// Judges `bound` against what the workload's pods showed.
pub fn judge(bound: &StartBound, observed: &[ColdStart]) -> Verdict {
    let slowest_ready = observed
        .iter()
        .filter_map(|o| match o {
            ColdStart::Ready(d) => Some(*d),
            ColdStart::KilledAfter(_) | ColdStart::BeforeProbe(_) => None,
        })
        .max();
    let longest_killed = observed
        .iter()
        .filter_map(|o| match o {
            ColdStart::KilledAfter(d) => Some(*d),
            ColdStart::Ready(_) | ColdStart::BeforeProbe(_) => None,
        })
        .max();
    let not_real = observed.iter().find_map(|o| match o {
        ColdStart::BeforeProbe(d) => Some(*d),
        _ => None,
    });
    let Some(probe) = bound.probe() else {
        return match slowest_ready {
            Some(slowest) => Verdict::Ok {
                window: None,
                slowest,
            },
            None => Verdict::Unknown {
                missing: "no pod of the workload has become Ready yet".into(),
            },
        };
    };
    let window = probe.window();
    // A kill during start means the start outlasted the window; a Ready
    // later than the window means the probe was lucky or slow to act.
    let needs = match (slowest_ready, longest_killed) {
        (Some(r), Some(k)) => Some(r.max(k)),
        (Some(r), None) if r > window => Some(r),
        (None, Some(k)) => Some(k.max(window)),
        _ => None,
    };
    if let Some(needs_at_least) = needs {
        return Verdict::WindowTooShort {
            window,
            needs_at_least,
            recommended: recommend(&probe, needs_at_least),
        };
    }
    match (slowest_ready, not_real) {
        (Some(slowest), _) => Verdict::Ok {
            window: Some(window),
            slowest,
        },
        (None, Some(d)) => Verdict::Unknown {
            missing: format!(
                "the only Ready seen came {}s after the start, before the startup probe's initialDelaySeconds {}s, which no kubelet allows: not a real cold start",
                d.as_secs(),
                probe.initial_delay_seconds
            ),
        },
        (None, None) => Verdict::Unknown {
            missing: "no pod of the workload has become Ready or been killed by its probe yet"
                .into(),
        },
    }
}

/// A startup probe like `current` whose window covers `cold_start` with
/// [`MARGIN_PERCENT`] to spare, by raising `failureThreshold` only: the
/// period and timeout keep their meaning once the container runs.
pub fn recommend(current: &ProbeTiming, cold_start: Duration) -> ProbeTiming {
    let target = cold_start.as_secs() * (100 + MARGIN_PERCENT) / 100 + 1;
    let attempt = u64::from(current.period_seconds.max(current.timeout_seconds).max(1));
    let after_delay = target.saturating_sub(u64::from(current.initial_delay_seconds));
    let failures = after_delay.div_ceil(attempt).max(1);
    ProbeTiming {
        failure_threshold: u32::try_from(failures).unwrap_or(u32::MAX),
        ..*current
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    /// The incident's vLLM probe: 30 s delay, then 30 tries of 10 s.
    const INCIDENT: ProbeTiming = ProbeTiming {
        initial_delay_seconds: 30,
        period_seconds: 10,
        timeout_seconds: 5,
        failure_threshold: 30,
    };

    #[test]
    fn a_ready_before_the_startup_probe_could_run_is_no_evidence() {
        let slow_delay = ProbeTiming {
            initial_delay_seconds: 600,
            ..INCIDENT
        };
        let bound = StartBound::Startup(slow_delay);
        match judge(&bound, &[ColdStart::BeforeProbe(secs(0))]) {
            Verdict::Unknown { missing } => {
                assert!(missing.contains("initialDelaySeconds 600s"), "{missing}");
            }
            other => panic!("a 0 s start under a 600 s delay judged {other:?}"),
        }
        // Beside a real start, it changes nothing.
        assert_eq!(
            judge(
                &bound,
                &[ColdStart::BeforeProbe(secs(0)), ColdStart::Ready(secs(700))]
            ),
            judge(&bound, &[ColdStart::Ready(secs(700))])
        );
    }

    #[test]
    fn the_window_is_delay_plus_tries_of_the_longer_of_period_and_timeout() {
        assert_eq!(INCIDENT.window(), secs(330));
        assert_eq!(ProbeTiming::default().window(), secs(30));
        let slow = ProbeTiming {
            timeout_seconds: 20,
            ..INCIDENT
        };
        assert_eq!(slow.window(), secs(30 + 30 * 20), "timeout > period");
    }

    #[test]
    fn the_incident_is_a_window_too_short_with_a_fix() {
        let bound = StartBound::of(Some(INCIDENT), Some(ProbeTiming::default()));
        // Two pods killed by the probe; one that made it took 760 s.
        let observed = [
            ColdStart::KilledAfter(secs(331)),
            ColdStart::KilledAfter(secs(332)),
            ColdStart::Ready(secs(760)),
        ];
        match judge(&bound, &observed) {
            Verdict::WindowTooShort {
                window,
                needs_at_least,
                recommended,
            } => {
                assert_eq!(window, secs(330));
                assert_eq!(needs_at_least, secs(760));
                assert!(recommended.window() >= secs(760 * 3 / 2), "{recommended:?}");
                assert_eq!(recommended.period_seconds, 10);
                assert_eq!(recommended.initial_delay_seconds, 30);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn only_kills_seen_gives_a_lower_bound() {
        let bound = StartBound::of(Some(INCIDENT), None);
        match judge(&bound, &[ColdStart::KilledAfter(secs(331))]) {
            Verdict::WindowTooShort { needs_at_least, .. } => {
                assert_eq!(needs_at_least, secs(331));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_long_enough_window_is_ok_and_no_data_is_unknown() {
        let bound = StartBound::of(Some(INCIDENT), None);
        assert_eq!(
            judge(&bound, &[ColdStart::Ready(secs(200))]),
            Verdict::Ok {
                window: Some(secs(330)),
                slowest: secs(200)
            }
        );
        assert!(matches!(judge(&bound, &[]), Verdict::Unknown { .. }));
    }

    #[test]
    fn without_a_startup_probe_liveness_bounds_the_start() {
        let liveness = ProbeTiming {
            initial_delay_seconds: 60,
            ..ProbeTiming::default()
        };
        let bound = StartBound::of(None, Some(liveness));
        assert_eq!(bound, StartBound::Liveness(liveness));
        assert!(matches!(
            judge(&bound, &[ColdStart::Ready(secs(600))]),
            Verdict::WindowTooShort { window, .. } if window == secs(90)
        ));
    }

    #[test]
    fn with_no_probe_nothing_kills_a_slow_start() {
        let bound = StartBound::of(None, None);
        assert_eq!(bound.window(), None);
        assert!(matches!(
            judge(&bound, &[ColdStart::Ready(secs(900))]),
            Verdict::Ok { window: None, .. }
        ));
    }

    fn timing() -> impl Strategy<Value = ProbeTiming> {
        (0u32..600, 1u32..60, 1u32..120, 1u32..100).prop_map(|(d, p, t, f)| ProbeTiming {
            initial_delay_seconds: d,
            period_seconds: p,
            timeout_seconds: t,
            failure_threshold: f,
        })
    }

    proptest! {
        /// A recommendation always covers the cold start with the margin,
        /// and changes nothing but the failure threshold.
        #[test]
        fn a_recommendation_covers_the_cold_start(current in timing(), cold in 1u64..5_000) {
            let r = recommend(&current, secs(cold));
            prop_assert!(r.window() >= secs(cold * (100 + MARGIN_PERCENT) / 100));
            prop_assert_eq!(
                (r.initial_delay_seconds, r.period_seconds, r.timeout_seconds),
                (current.initial_delay_seconds, current.period_seconds, current.timeout_seconds)
            );
        }

        /// The verdict never calls a start that outlasted the window Ok.
        #[test]
        fn a_start_longer_than_the_window_is_never_ok(current in timing(), ready in 1u64..5_000) {
            let bound = StartBound::Startup(current);
            let verdict = judge(&bound, &[ColdStart::Ready(secs(ready))]);
            if secs(ready) > current.window() {
                prop_assert!(matches!(verdict, Verdict::WindowTooShort { .. }), "{:?}", verdict);
            } else {
                prop_assert!(matches!(verdict, Verdict::Ok { .. }), "{:?}", verdict);
            }
        }
    }
}
