//! The promises a chaos run checks afterwards (issue 9), over what an
//! independent watcher saw during the run, in the order it saw it. Pure, so
//! that each check is tested here, with no cluster, against the violation
//! it must catch.

use std::collections::{BTreeMap, BTreeSet};

use gpuhealth_api::{node_health::Phase, vocabulary::Reason};
use gpuhealth_engine::machine::is_disruptive;

/// One change seen on a watch.
#[derive(Clone, Debug, PartialEq)]
pub enum Seen {
    /// A node's `GpuNodeHealth` status.
    Health {
        node: String,
        policy: Option<String>,
        phase: Phase,
        reason: Option<Reason>,
    },
    /// A node's `spec.unschedulable`.
    Cordon { node: String, unschedulable: bool },
    /// A pod gone from the cluster (`namespace/name`), and whether it was
    /// annotated `gpuhealth.io/disruption-tolerance: never`.
    PodGone { pod: String, never: bool },
    /// The agent carried out request `id` on `node` (as the simulated
    /// hardware recorded it).
    Executed { node: String, id: String },
    /// A reset or reboot request annotation on `node`, whole.
    Request {
        node: String,
        id: String,
        value: String,
    },
    /// One of gpuhealth's `DeviceTaintRule`s for `node`, up or gone.
    Fence {
        node: String,
        rule: String,
        up: bool,
    },
}

/// What the run set up, against which the timeline is judged.
#[derive(Clone, Debug, Default)]
pub struct Expectations {
    /// Each policy's `maxConcurrent`, as a node count.
    pub max_concurrent: BTreeMap<String, usize>,
    /// Nodes the run cordoned itself before the timeline starts and left
    /// cordoned: nobody else may uncordon them.
    pub foreign_cordons: BTreeSet<String>,
    /// Pods the run deleted itself.
    pub deleted_by_run: BTreeSet<String>,
    /// Nodes the run made sick, with how each must end: `Healthy`, or
    /// `Failed` with a reason.
    pub sick: BTreeMap<String, Phase>,
}

/// A broken promise, with what shows it.
#[derive(Clone, Debug, PartialEq)]
pub enum Violation {
    OverBudget {
        policy: String,
        limit: usize,
        disrupted: Vec<String>,
    },
    ForeignUncordon {
        node: String,
    },
    NeverPodEvicted {
        pod: String,
    },
    ExecutedTwice {
        node: String,
        id: String,
    },
    /// One request id written with two different values: the agent may
    /// have read either.
    RequestRewritten {
        node: String,
        id: String,
    },
    /// Something the scenario sets out to show did not happen (the circuit
    /// breaker never opened in a storm).
    Missing {
        what: String,
    },
    NotSettled {
        node: String,
        expected: Phase,
        phase: Option<Phase>,
        reason: Option<Reason>,
    },
    /// A node drained or acted on while neither it was cordoned nor any
    /// GPU of it fenced: new work could land on its bad GPU.
    Unfenced {
        node: String,
        phase: Phase,
    },
    /// A rule still up for a node back in service: its GPU fenced forever.
    RuleOutlivedIncident {
        node: String,
        rule: String,
    },
}

/// Every promise `timeline` breaks; empty when it keeps them all.
pub fn check(timeline: &[Seen], expect: &Expectations) -> Vec<Violation> {
    let mut violations = Vec::new();
    // Per node: its latest health, and whether a foreign cordon is on it.
    let mut health: BTreeMap<&str, (&Option<String>, Phase, &Option<Reason>)> = BTreeMap::new();
    // The run made them before the timeline starts.
    let mut foreign_on: BTreeSet<&str> =
        expect.foreign_cordons.iter().map(String::as_str).collect();
    let mut executed: BTreeSet<(&str, &str)> = BTreeSet::new();
    let mut requests: BTreeMap<(&str, &str), &str> = BTreeMap::new();
    // Report each policy's worst moment once, not every event past it.
    let mut over: BTreeMap<String, Vec<String>> = BTreeMap::new();
    // Per node: whether it is cordoned, and the rules of gpuhealth's up.
    let mut cordoned: BTreeSet<&str> = expect.foreign_cordons.iter().map(String::as_str).collect();
    let mut fences: BTreeMap<&str, BTreeSet<&str>> = BTreeMap::new();
    let mut unfenced: BTreeSet<&str> = BTreeSet::new();
    for seen in timeline {
        match seen {
            Seen::Health {
                node,
                policy,
                phase,
                reason,
            } => {
                health.insert(node, (policy, *phase, reason));
                let fenced = cordoned.contains(node.as_str())
                    || fences.get(node.as_str()).is_some_and(|r| !r.is_empty());
                if matches!(phase, Phase::Draining | Phase::Remediating)
                    && !fenced
                    && unfenced.insert(node)
                {
                    violations.push(Violation::Unfenced {
                        node: node.clone(),
                        phase: *phase,
                    });
                }
                let Some(p) = policy else { continue };
                let disrupted: Vec<String> = health
                    .iter()
                    .filter(|(_, (q, phase, _))| q.as_ref() == Some(p) && is_disruptive(*phase))
                    .map(|(n, _)| (*n).to_owned())
                    .collect();
                let limit = expect.max_concurrent.get(p).copied().unwrap_or(usize::MAX);
                let worst = over.get(p).map_or(limit, Vec::len);
                if disrupted.len() > worst {
                    over.insert(p.clone(), disrupted);
                }
            }
            Seen::Cordon {
                node,
                unschedulable,
            } => {
                if *unschedulable {
                    cordoned.insert(node);
                } else {
                    cordoned.remove(node.as_str());
                }
                if !expect.foreign_cordons.contains(node) {
                    continue;
                }
                if *unschedulable {
                    foreign_on.insert(node);
                } else if foreign_on.remove(node.as_str()) {
                    violations.push(Violation::ForeignUncordon { node: node.clone() });
                }
            }
            Seen::PodGone { pod, never } => {
                if *never && !expect.deleted_by_run.contains(pod) {
                    violations.push(Violation::NeverPodEvicted { pod: pod.clone() });
                }
            }
            Seen::Executed { node, id } => {
                if !executed.insert((node, id)) {
                    violations.push(Violation::ExecutedTwice {
                        node: node.clone(),
                        id: id.clone(),
                    });
                }
            }
            Seen::Request { node, id, value } => {
                let first = *requests.entry((node, id)).or_insert(value);
                if first != value {
                    violations.push(Violation::RequestRewritten {
                        node: node.clone(),
                        id: id.clone(),
                    });
                }
            }
            Seen::Fence { node, rule, up } => {
                let rules = fences.entry(node).or_default();
                if *up {
                    rules.insert(rule);
                } else {
                    rules.remove(rule.as_str());
                }
            }
        }
    }
    for (node, rules) in &fences {
        if matches!(health.get(node), Some((_, Phase::Healthy, _))) {
            for rule in rules {
                violations.push(Violation::RuleOutlivedIncident {
                    node: (*node).to_owned(),
                    rule: (*rule).to_owned(),
                });
            }
        }
    }
    for (policy, disrupted) in over {
        violations.push(Violation::OverBudget {
            limit: expect
                .max_concurrent
                .get(&policy)
                .copied()
                .unwrap_or(usize::MAX),
            policy,
            disrupted,
        });
    }
    for (node, expected) in &expect.sick {
        let last = health.get(node.as_str());
        let settled = match last {
            Some((_, Phase::Healthy, _)) => *expected == Phase::Healthy,
            Some((_, Phase::Failed, reason)) => *expected == Phase::Failed && reason.is_some(),
            _ => false,
        };
        if !settled {
            violations.push(Violation::NotSettled {
                node: node.clone(),
                expected: *expected,
                phase: last.map(|(_, p, _)| *p),
                reason: last.and_then(|(_, _, r)| **r),
            });
        }
    }
    violations
}

/// How many of gpuhealth's rules for `node` are up at the end of
/// `timeline` (counting only those it saw go up).
pub fn fences_up(timeline: &[Seen], node: &str) -> usize {
    let mut up = BTreeSet::new();
    for seen in timeline {
        if let Seen::Fence {
            node: n,
            rule,
            up: is_up,
        } = seen
            && n == node
        {
            if *is_up {
                up.insert(rule);
            } else {
                up.remove(rule);
            }
        }
    }
    up.len()
}

/// Whether `node` was last seen unschedulable in `timeline`, if it was
/// seen at all.
pub fn cordoned(timeline: &[Seen], node: &str) -> Option<bool> {
    timeline.iter().rev().find_map(|s| match s {
        Seen::Cordon {
            node: n,
            unschedulable,
        } if n == node => Some(*unschedulable),
        _ => None,
    })
}

/// `node`'s latest phase in `timeline`, if it is there.
pub fn latest_phase(timeline: &[Seen], node: &str) -> Option<Phase> {
    timeline.iter().rev().find_map(|s| match s {
        Seen::Health { node: n, phase, .. } if n == node => Some(*phase),
        _ => None,
    })
}

/// How `node` ended in `timeline`: `Healthy` or `Failed` once it has been
/// anything else in it; `None` while it is still on its way (or was never
/// sick).
pub fn ending(timeline: &[Seen], node: &str) -> Option<Phase> {
    let mut sick = false;
    let mut last = None;
    for seen in timeline {
        if let Seen::Health { node: n, phase, .. } = seen
            && n == node
        {
            sick |= *phase != Phase::Healthy;
            last = Some(*phase);
        }
    }
    last.filter(|p| sick && matches!(p, Phase::Healthy | Phase::Failed))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn health(node: &str, phase: Phase) -> Seen {
        Seen::Health {
            node: node.into(),
            policy: Some("p".into()),
            phase,
            reason: (phase == Phase::Failed).then_some(Reason::EscalationExhausted),
        }
    }

    fn expect() -> Expectations {
        Expectations {
            max_concurrent: [("p".to_owned(), 2)].into(),
            foreign_cordons: ["human".to_owned()].into(),
            deleted_by_run: ["ns/deleted-by-the-run".to_owned()].into(),
            sick: [
                ("a".to_owned(), Phase::Healthy),
                ("b".to_owned(), Phase::Failed),
            ]
            .into(),
        }
    }

    /// A run that keeps every promise: two nodes at a time at most, the
    /// foreign cordon left alone, the `never` pod deleted only by the run.
    fn kept() -> Vec<Seen> {
        vec![
            Seen::Cordon {
                node: "human".into(),
                unschedulable: true,
            },
            health("a", Phase::Quarantined),
            Seen::Cordon {
                node: "b".into(),
                unschedulable: true,
            },
            health("b", Phase::Draining),
            Seen::Request {
                node: "a".into(),
                id: "inc-1-reset-1".into(),
                value: "reset at 10:00:00".into(),
            },
            Seen::Request {
                node: "a".into(),
                id: "inc-1-reset-1".into(),
                value: "reset at 10:00:00".into(),
            },
            Seen::Executed {
                node: "a".into(),
                id: "inc-1-reset-1".into(),
            },
            health("a", Phase::Healthy),
            health("c", Phase::Quarantined),
            Seen::PodGone {
                pod: "ns/deleted-by-the-run".into(),
                never: true,
            },
            health("b", Phase::Failed),
            health("c", Phase::Healthy),
            // A GPU fenced alone: never cordoned, its rule up throughout.
            health("f", Phase::Quarantined),
            Seen::Fence {
                node: "f".into(),
                rule: "gpuhealth-inc-2-gpu-7".into(),
                up: true,
            },
            health("f", Phase::Draining),
            health("f", Phase::Remediating),
            health("f", Phase::Verifying),
            health("f", Phase::Healthy),
            Seen::Fence {
                node: "f".into(),
                rule: "gpuhealth-inc-2-gpu-7".into(),
                up: false,
            },
        ]
    }

    #[test]
    fn a_node_has_ended_once_back_healthy_or_failed_after_being_sick() {
        let timeline = kept();
        assert_eq!(ending(&timeline, "a"), Some(Phase::Healthy));
        assert_eq!(ending(&timeline, "b"), Some(Phase::Failed));
        assert_eq!(ending(&timeline[..3], "b"), None, "still draining");
        assert_eq!(
            ending(&[health("d", Phase::Healthy)], "d"),
            None,
            "never sick"
        );
    }

    #[test]
    fn a_foreign_cordon_made_before_the_timeline_is_still_guarded() {
        let timeline = vec![
            health("a", Phase::Healthy),
            Seen::Cordon {
                node: "human".into(),
                unschedulable: false,
            },
        ];
        let expect = Expectations {
            foreign_cordons: ["human".to_owned()].into(),
            ..Default::default()
        };
        assert_eq!(
            check(&timeline, &expect),
            [Violation::ForeignUncordon {
                node: "human".into()
            }]
        );
    }

    #[test]
    fn a_run_that_keeps_its_promises_has_no_violation() {
        assert_eq!(check(&kept(), &expect()), []);
    }

    #[test]
    fn each_broken_promise_is_caught() {
        let mut timeline = kept();
        // A third node disrupted while two still are, once.
        let cordon = |node: &str| Seen::Cordon {
            node: node.into(),
            unschedulable: true,
        };
        timeline.insert(4, cordon("d"));
        timeline.insert(5, health("d", Phase::Remediating));
        timeline.insert(6, cordon("e"));
        timeline.insert(7, health("e", Phase::Remediating));
        timeline.push(Seen::Cordon {
            node: "human".into(),
            unschedulable: false,
        });
        timeline.push(Seen::PodGone {
            pod: "ns/training".into(),
            never: true,
        });
        timeline.push(Seen::Executed {
            node: "a".into(),
            id: "inc-1-reset-1".into(),
        });
        timeline.push(Seen::Request {
            node: "a".into(),
            id: "inc-1-reset-1".into(),
            value: "reset at 10:00:01".into(),
        });
        // Drained with neither a cordon nor a fence; a rule left up after
        // recovery.
        timeline.push(health("g", Phase::Draining));
        timeline.push(Seen::Fence {
            node: "c".into(),
            rule: "gpuhealth-inc-1-gpu-3".into(),
            up: true,
        });
        timeline.push(Seen::Health {
            node: "b".into(),
            policy: Some("p".into()),
            phase: Phase::Failed,
            reason: None,
        });
        let found = check(&timeline, &expect());
        assert_eq!(
            found,
            [
                Violation::ForeignUncordon {
                    node: "human".into()
                },
                Violation::NeverPodEvicted {
                    pod: "ns/training".into()
                },
                Violation::ExecutedTwice {
                    node: "a".into(),
                    id: "inc-1-reset-1".into()
                },
                Violation::RequestRewritten {
                    node: "a".into(),
                    id: "inc-1-reset-1".into()
                },
                Violation::Unfenced {
                    node: "g".into(),
                    phase: Phase::Draining
                },
                Violation::RuleOutlivedIncident {
                    node: "c".into(),
                    rule: "gpuhealth-inc-1-gpu-3".into()
                },
                Violation::OverBudget {
                    policy: "p".into(),
                    limit: 2,
                    disrupted: vec!["a".into(), "b".into(), "d".into(), "e".into()],
                },
                Violation::NotSettled {
                    node: "b".into(),
                    expected: Phase::Failed,
                    phase: Some(Phase::Failed),
                    reason: None
                },
            ]
        );
    }

    #[test]
    fn a_sick_node_never_seen_still_working_or_ending_otherwise_is_not_settled() {
        let timeline = vec![health("a", Phase::Verifying)];
        let found = check(&timeline, &expect());
        assert_eq!(
            found,
            [
                Violation::NotSettled {
                    node: "a".into(),
                    expected: Phase::Healthy,
                    phase: Some(Phase::Verifying),
                    reason: None
                },
                Violation::NotSettled {
                    node: "b".into(),
                    expected: Phase::Failed,
                    phase: None,
                    reason: None
                },
            ]
        );
        // Failed where it should have recovered, and the other way round.
        let timeline = vec![health("a", Phase::Failed), health("b", Phase::Healthy)];
        assert_eq!(check(&timeline, &expect()).len(), 2);
    }
}
