//! Long because each violation the checker must catch has a test of its
//! own, each with the hand-made timeline that shows it.

use super::*;

fn health(node: &str, phase: Phase) -> Seen {
    Seen::Health {
        node: node.into(),
        policy: Some("p".into()),
        phase,
        reason: (phase == Phase::Failed).then_some(Reason::EscalationExhausted),
    }
}

/// gpuhealth's cordon (with its record) on or off.
fn cordon(node: &str, on: bool) -> Seen {
    Seen::Cordon {
        node: node.into(),
        unschedulable: on,
        ours: on,
    }
}

/// A person's cordon.
fn persons_cordon(node: &str, on: bool) -> Seen {
    Seen::Cordon {
        node: node.into(),
        unschedulable: on,
        ours: false,
    }
}

/// `node`'s hardware: GPU `<node>-<i>` bad where `bad` says, held by the
/// pods given for it.
fn hardware(node: &str, gpus: &[(usize, bool, &[&str])]) -> Seen {
    Seen::Hardware {
        node: node.into(),
        gpus: gpus
            .iter()
            .map(|(i, bad, pods)| SimGpu {
                uuid: format!("{node}-{i}"),
                device: format!("gpu-{i}"),
                bad: *bad,
                pods: pods.iter().map(|p| (*p).to_owned()).collect(),
            })
            .collect(),
    }
}

fn pod_up(pod: &str, node: &str) -> Seen {
    Seen::PodUp {
        pod: pod.into(),
        node: Some(node.into()),
    }
}

fn evicted(pod: &str) -> Seen {
    Seen::PodGone {
        pod: pod.into(),
        never: false,
        evicted: true,
    }
}

fn reset(node: &str, gpu: usize, id: &str) -> Seen {
    Seen::Request {
        node: node.into(),
        id: id.into(),
        value: format!("reset {node}-{gpu} as {id}"),
        target: Target::Gpus(vec![format!("{node}-{gpu}")]),
    }
}

fn fence(node: &str, rule: &str, up: bool) -> Seen {
    Seen::Fence {
        node: node.into(),
        rule: rule.into(),
        up,
        device: None,
    }
}

/// gpuhealth's rule `rule` up on `node`, tainting GPU `gpu`'s device.
fn rule_on(node: &str, rule: &str, gpu: usize) -> Seen {
    Seen::Fence {
        node: node.into(),
        rule: rule.into(),
        up: true,
        device: Some(format!("gpu-{gpu}")),
    }
}

/// `pod`'s claim allocated GPU `gpu`'s device on `node`.
fn claimed(pod: &str, node: &str, gpu: usize) -> Seen {
    Seen::Claimed {
        pod: pod.into(),
        node: node.into(),
        device: format!("gpu-{gpu}"),
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

/// A run that keeps every promise: two nodes disrupted at a time at most,
/// the foreign cordon left alone, pods gone before the request, the cordon
/// lifted once the GPU is good, the `never` pod deleted only by the run, a
/// GPU fenced alone and only its pod evicted.
fn kept() -> Vec<Seen> {
    vec![
        persons_cordon("human", true),
        hardware("a", &[(0, true, &["ns/a-pod"]), (1, false, &[])]),
        pod_up("ns/a-pod", "a"),
        health("a", Phase::Quarantined),
        cordon("a", true),
        health("b", Phase::Quarantined),
        cordon("b", true),
        health("b", Phase::Draining),
        health("a", Phase::Draining),
        evicted("ns/a-pod"),
        reset("a", 0, "inc-1-reset-1"),
        // The same value again (a rewrite of the whole annotation).
        reset("a", 0, "inc-1-reset-1"),
        Seen::Executed {
            node: "a".into(),
            id: "inc-1-reset-1".into(),
        },
        hardware("a", &[(0, false, &["ns/a-pod"]), (1, false, &[])]),
        // Handed to a person: still cordoned, no longer gpuhealth's to count.
        health("b", Phase::Failed),
        health("c", Phase::Quarantined),
        cordon("c", true),
        health("a", Phase::Healthy),
        cordon("a", false),
        Seen::PodGone {
            pod: "ns/deleted-by-the-run".into(),
            never: true,
            evicted: false,
        },
        health("c", Phase::Healthy),
        cordon("c", false),
        // A GPU fenced alone: never cordoned, its rule up throughout, only
        // the pod on the bad GPU evicted.
        hardware(
            "f",
            &[(7, true, &["ns/f-pod"]), (1, false, &["ns/f-other"])],
        ),
        pod_up("ns/f-pod", "f"),
        pod_up("ns/f-other", "f"),
        health("f", Phase::Quarantined),
        fence("f", "gpuhealth-inc-2-gpu-7", true),
        health("f", Phase::Draining),
        evicted("ns/f-pod"),
        reset("f", 7, "inc-2-reset-1"),
        hardware("f", &[(7, false, &[]), (1, false, &["ns/f-other"])]),
        health("f", Phase::Healthy),
        fence("f", "gpuhealth-inc-2-gpu-7", false),
    ]
}

#[test]
fn a_node_has_ended_once_back_healthy_or_failed_after_being_sick() {
    let timeline = kept();
    assert_eq!(ending(&timeline, "a"), Some(Phase::Healthy));
    assert_eq!(ending(&timeline, "b"), Some(Phase::Failed));
    assert_eq!(ending(&timeline[..8], "b"), None, "still draining");
    assert_eq!(
        ending(&[health("d", Phase::Healthy)], "d"),
        None,
        "never sick"
    );
}

#[test]
fn a_foreign_cordon_made_before_the_timeline_is_still_guarded() {
    let timeline = vec![health("a", Phase::Healthy), persons_cordon("human", false)];
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

/// `kept()` with `seen` put in before its entry `at`.
fn kept_with(at: usize, seen: impl IntoIterator<Item = Seen>) -> Vec<Violation> {
    let mut timeline = kept();
    for (i, s) in seen.into_iter().enumerate() {
        timeline.insert(at + i, s);
    }
    check(&timeline, &expect())
}

#[test]
fn more_nodes_fenced_in_remediation_than_max_concurrent_is_over_budget() {
    // Two more fenced while a and b are, one by its cordon, one by a rule.
    let found = kept_with(
        7,
        [
            health("d", Phase::Remediating),
            cordon("d", true),
            health("e", Phase::Draining),
            fence("e", "gpuhealth-inc-3-gpu-1", true),
            fence("e", "gpuhealth-inc-3-gpu-1", false),
            cordon("d", false),
        ],
    );
    assert_eq!(
        found,
        [Violation::OverBudget {
            policy: "p".into(),
            limit: 2,
            disrupted: vec!["a".into(), "b".into(), "d".into(), "e".into()],
        }]
    );
}

#[test]
fn a_node_fenced_while_a_recovered_one_still_is_over_budget() {
    // `a` says Healthy but still carries the cordon: `c` makes three.
    let timeline = [
        health("a", Phase::Quarantined),
        cordon("a", true),
        health("b", Phase::Quarantined),
        cordon("b", true),
        health("a", Phase::Healthy),
        health("c", Phase::Quarantined),
        cordon("c", true),
        cordon("a", false),
    ];
    let budget = Expectations {
        max_concurrent: [("p".to_owned(), 2)].into(),
        ..Default::default()
    };
    assert_eq!(
        check(&timeline, &budget),
        [Violation::OverBudget {
            policy: "p".into(),
            limit: 2,
            disrupted: vec!["a".into(), "b".into(), "c".into()],
        }]
    );
}

#[test]
fn handed_over_nodes_given_back_together_are_not_over_budget() {
    // Three nodes handed over with their GPUs fenced, two at a time at
    // most while remediated; given back, each says Healthy a moment
    // before its rule goes: three fenced and Healthy, nothing started.
    let rule = |n: &str| format!("gpuhealth-inc-{n}-gpu-0");
    let mut timeline = Vec::new();
    for n in ["x", "y"] {
        timeline.extend([health(n, Phase::Quarantined), fence(n, &rule(n), true)]);
    }
    timeline.extend([health("x", Phase::Failed), health("y", Phase::Failed)]);
    timeline.extend([
        health("z", Phase::Quarantined),
        fence("z", &rule("z"), true),
        health("z", Phase::Failed),
    ]);
    timeline.extend(["x", "y", "z"].map(|n| health(n, Phase::Healthy)));
    timeline.extend(["x", "y", "z"].map(|n| fence(n, &rule(n), false)));
    let budget = Expectations {
        max_concurrent: [("p".to_owned(), 2)].into(),
        ..Default::default()
    };
    assert_eq!(check(&timeline, &budget), []);
}

#[test]
fn a_request_while_a_pod_still_runs_on_its_gpu_is_caught() {
    // The reset written before the pod on GPU 0 was gone.
    let mut timeline = kept();
    let request = timeline.remove(10);
    timeline.insert(9, request);
    assert_eq!(
        check(&timeline, &expect()),
        [Violation::RequestWhileHeld {
            node: "a".into(),
            id: "inc-1-reset-1".into(),
            pod: "ns/a-pod".into(),
        }]
    );
    // A pod on another GPU does not hold a reset of GPU 0; a reboot's
    // scope is the whole node.
    let other = [
        pod_up("ns/a-other", "a"),
        hardware(
            "a",
            &[(0, true, &["ns/a-pod"]), (1, false, &["ns/a-other"])],
        ),
    ];
    assert_eq!(kept_with(9, other.clone()), []);
    let reboot = Seen::Request {
        node: "a".into(),
        id: "inc-1-reboot-1".into(),
        value: "reboot".into(),
        target: Target::Node,
    };
    assert_eq!(
        kept_with(10, other.into_iter().chain([reboot])),
        [Violation::RequestWhileHeld {
            node: "a".into(),
            id: "inc-1-reboot-1".into(),
            pod: "ns/a-other".into(),
        }]
    );
}

#[test]
fn an_uncordon_while_the_gpu_is_still_bad_is_caught() {
    // The hardware's mending removed: a's cordon goes while GPU 0 is bad.
    let mut timeline = kept();
    timeline.remove(13);
    assert_eq!(
        check(&timeline, &expect()),
        [Violation::UncordonedWhileBad { node: "a".into() }]
    );
}

#[test]
fn gpuhealths_cordon_left_on_a_healthy_node_is_caught() {
    let mut timeline = kept();
    let uncordon = timeline.iter().position(|s| *s == cordon("c", false));
    timeline.remove(uncordon.unwrap_or_default());
    assert_eq!(
        check(&timeline, &expect()),
        [Violation::CordonOutlivedIncident { node: "c".into() }]
    );
    // A person's cordon on a healthy node is the person's.
    let mut timeline = kept();
    timeline.push(persons_cordon("c", true));
    assert_eq!(check(&timeline, &expect()), []);
}

#[test]
fn an_eviction_outside_the_fenced_gpu_or_on_an_unfenced_node_is_caught() {
    let end = kept().len();
    let found = kept_with(
        end - 2,
        [
            evicted("ns/f-other"),
            hardware("g", &[(2, true, &["ns/g-pod"])]),
            pod_up("ns/g-pod", "g"),
            evicted("ns/g-pod"),
            reset("g", 2, "inc-4-reset-1"),
        ],
    );
    assert_eq!(
        found,
        [
            Violation::EvictedOutsideScope {
                pod: "ns/f-other".into(),
                node: "f".into(),
            },
            Violation::Unfenced {
                node: "g".into(),
                what: "ns/g-pod evicted".into(),
            },
        ]
    );
    // A pod deleted (not evicted) by someone else is not gpuhealth's doing.
    let deleted = Seen::PodGone {
        pod: "ns/f-other".into(),
        never: false,
        evicted: false,
    };
    assert_eq!(kept_with(end - 2, [deleted]), []);
}

#[test]
fn the_other_broken_promises_are_caught() {
    let mut timeline = kept();
    timeline.push(persons_cordon("human", false));
    timeline.push(Seen::PodGone {
        pod: "ns/training".into(),
        never: true,
        evicted: true,
    });
    timeline.push(Seen::Executed {
        node: "a".into(),
        id: "inc-1-reset-1".into(),
    });
    timeline.push(Seen::Request {
        node: "a".into(),
        id: "inc-1-reset-1".into(),
        value: "reset at 10:00:01".into(),
        target: Target::Gpus(vec!["a-0".into()]),
    });
    // A rule left up after recovery; b Failed without a reason.
    timeline.push(fence("c", "gpuhealth-inc-1-gpu-3", true));
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
            Violation::RuleOutlivedIncident {
                node: "c".into(),
                rule: "gpuhealth-inc-1-gpu-3".into()
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

#[test]
fn a_trial_is_judged_on_the_cluster_as_it_stood_when_it_began() {
    // The pod and the hardware were seen before the trial; the reset
    // while the pod still runs is the trial's. The foreign uncordon before
    // it is not.
    let timeline = vec![
        persons_cordon("human", false),
        pod_up("ns/a-pod", "a"),
        hardware("a", &[(0, true, &["ns/a-pod"])]),
        cordon("a", true),
        reset("a", 0, "inc-1-reset-1"),
    ];
    let expect = Expectations {
        foreign_cordons: ["human".to_owned()].into(),
        ..Default::default()
    };
    assert_eq!(
        check_from(&timeline, 4, &expect),
        [Violation::RequestWhileHeld {
            node: "a".into(),
            id: "inc-1-reset-1".into(),
            pod: "ns/a-pod".into(),
        }]
    );
    assert_eq!(check_from(&timeline, 5, &expect), []);
    assert_eq!(
        check(&timeline, &expect),
        [
            Violation::ForeignUncordon {
                node: "human".into()
            },
            Violation::RequestWhileHeld {
                node: "a".into(),
                id: "inc-1-reset-1".into(),
                pod: "ns/a-pod".into(),
            }
        ]
    );
}

#[test]
fn a_request_while_a_pod_claims_a_gpu_it_covers_is_caught() {
    // GPU 0 fenced alone, its first holder gone; then the scheduler gives
    // its device to a newcomer (a claim allocated before the rule, or
    // while it was gone), still there when the reset is written.
    let before = vec![
        hardware("a", &[(0, true, &[]), (1, false, &[])]),
        rule_on("a", "r0", 0),
        Seen::PodUp {
            pod: "ns/newcomer".into(),
            node: None,
        },
        claimed("ns/newcomer", "a", 0),
        pod_up("ns/newcomer", "a"),
    ];
    let mut held = before.clone();
    held.push(reset("a", 0, "inc-1-reset-1"));
    assert_eq!(
        check(&held, &Expectations::default()),
        [Violation::RequestWhileHeld {
            node: "a".into(),
            id: "inc-1-reset-1".into(),
            pod: "ns/newcomer".into(),
        }]
    );
    // Drained first: no violation, and its eviction is in the drain's
    // scope (it held the fenced GPU).
    let mut drained = before.clone();
    drained.extend([evicted("ns/newcomer"), reset("a", 0, "inc-1-reset-1")]);
    assert_eq!(check(&drained, &Expectations::default()), []);
    // A claim on another GPU holds nothing the reset covers.
    let mut elsewhere = before[..3].to_vec();
    elsewhere.extend([
        claimed("ns/newcomer", "a", 1),
        reset("a", 0, "inc-1-reset-1"),
    ]);
    assert_eq!(check(&elsewhere, &Expectations::default()), []);
}

#[test]
fn a_newcomer_on_a_gpu_fenced_for_verification_may_be_evicted_one_elsewhere_not() {
    // GPU 0 reset and healthy again, its rule still up while it is
    // verified: a pod the scheduler gave it while the rule was gone is
    // drained in scope; one on GPU 1, never fenced, is not.
    let timeline = vec![
        hardware("a", &[(0, false, &[]), (1, false, &[])]),
        rule_on("a", "r0", 0),
        pod_up("ns/newcomer", "a"),
        claimed("ns/newcomer", "a", 0),
        pod_up("ns/other", "a"),
        claimed("ns/other", "a", 1),
        evicted("ns/newcomer"),
        evicted("ns/other"),
    ];
    assert_eq!(
        check(&timeline, &Expectations::default()),
        [Violation::EvictedOutsideScope {
            pod: "ns/other".into(),
            node: "a".into(),
        }]
    );
}

#[test]
fn a_pods_claims_go_with_it() {
    // A pod of the same name made later holds nothing until its own claim
    // is allocated.
    let timeline = vec![
        hardware("a", &[(0, true, &[])]),
        rule_on("a", "r0", 0),
        pod_up("ns/web", "a"),
        claimed("ns/web", "a", 0),
        Seen::PodGone {
            pod: "ns/web".into(),
            never: false,
            evicted: false,
        },
        pod_up("ns/web", "a"),
        reset("a", 0, "inc-1-reset-1"),
    ];
    assert_eq!(check(&timeline, &Expectations::default()), []);
}

#[test]
fn a_reset_carried_out_while_a_newcomer_holds_its_gpu_is_caught() {
    // The request is written with GPU 0 free; while it runs, the scheduler
    // gives the device to a pod (its rule deleted meanwhile).
    let before = vec![
        hardware("a", &[(0, true, &[])]),
        rule_on("a", "r0", 0),
        reset("a", 0, "inc-1-reset-1"),
        fence("a", "r0", false),
        pod_up("ns/newcomer", "a"),
        claimed("ns/newcomer", "a", 0),
        rule_on("a", "r0", 0),
    ];
    let executed = Seen::Executed {
        node: "a".into(),
        id: "inc-1-reset-1".into(),
    };
    let mut kept = before.clone();
    kept.push(executed.clone());
    assert_eq!(
        check(&kept, &Expectations::default()),
        [Violation::CarriedOutWhileHeld {
            node: "a".into(),
            id: "inc-1-reset-1".into(),
            pod: "ns/newcomer".into(),
        }]
    );
    let mut drained = before;
    drained.extend([evicted("ns/newcomer"), executed]);
    assert_eq!(check(&drained, &Expectations::default()), []);
}
