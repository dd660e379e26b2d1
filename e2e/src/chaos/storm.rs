//! Storms: 30 % of the nodes fail at once, each with one limit that must be
//! the one holding, so that a broken one cannot hide behind the other:
//!
//! - [`Limit::Breaker`]: `maxUnhealthy` 20 % (2 of 10) and `maxConcurrent`
//!   10. The circuit breaker must open (the policy says `CircuitOpen`), and
//!   no more nodes than the breaker allows may be disrupted: with the
//!   breaker broken, the third would be.
//! - [`Limit::MaxConcurrent`]: `maxConcurrent` 1 and `maxUnhealthy` 100 %.
//!   One node at a time; the breaker must never open.
//!
//! Once the faults clear on the nodes held back (a bad driver rolled back),
//! every node must be back in service.

use gpuhealth_api::{GpuHealth, GpuHealthPolicy, node_health::Phase};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::Api;

use super::{
    Fault, Rng, Row,
    fleet::{Fleet, SETTLE},
    policy, update_hardware,
};
use crate::{
    Result,
    invariants::{Seen, Violation, check_from, latest_phase},
    wait::until,
};

const NODES: usize = 10;

/// The limit a storm is built to be held by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    Breaker,
    MaxConcurrent,
}

pub async fn run(trials: usize, limit: Limit, rng: &mut Rng) -> Result<Row> {
    let (spec, name, title) = match limit {
        // More than two unhealthy is a storm; the budget would allow all.
        Limit::Breaker => (
            policy(NODES as i32, IntOrString::String("20%".into())),
            "chaos-storm",
            "storm: the breaker holds",
        ),
        Limit::MaxConcurrent => (
            policy(1, IntOrString::String("100%".into())),
            "chaos-storm1",
            "storm: maxConcurrent holds",
        ),
    };
    let mut fleet = Fleet::new(name, NODES, spec, 2).await?;
    let mut row = Row::new(title);
    for _ in 0..trials {
        let started = k8s_openapi::jiff::Timestamp::now();
        let (mut expect, violations) = fleet
            .trial(
                rng,
                NODES * 3 / 10,
                &[Fault::ResetHeals],
                async |fleet, _| {
                    let opened = match limit {
                        Limit::Breaker => circuit_opened(fleet).await,
                        Limit::MaxConcurrent => false,
                    };
                    // The faults clear where the breaker held a node back, once
                    // the recorder has seen each sick node taken in.
                    let sick = fleet.trial_sick.clone();
                    fleet
                        .recorder
                        .until(fleet.trial_mark, "every sick node taken in", SETTLE, |t| {
                            sick.iter().all(|n| taken_in(t, n))
                        })
                        .await?;
                    let timeline = fleet.recorder.since(fleet.trial_mark);
                    for node in held_back(&timeline, &fleet.trial_sick) {
                        update_hardware(&fleet.s.client, &node, |hw| {
                            for g in &mut hw.gpus {
                                g.health = GpuHealth::Healthy;
                                g.recovery_action = Some(0);
                                g.xids.clear();
                            }
                        })
                        .await?;
                    }
                    Ok(if opened || limit == Limit::MaxConcurrent {
                        Vec::new()
                    } else {
                        vec![Violation::Missing {
                            what: "the policy never said CircuitOpen".into(),
                        }]
                    })
                },
            )
            .await?;
        let mut violations = violations;
        match limit {
            // The breaker's limit, judged as a budget: two of ten.
            Limit::Breaker => {
                expect.max_concurrent = [(fleet.s.policy.clone(), 2)].into();
                let history = fleet.recorder.since(0);
                violations.extend(
                    check_from(&history, fleet.trial_mark, &expect)
                        .into_iter()
                        .filter(|v| matches!(v, Violation::OverBudget { .. })),
                );
            }
            Limit::MaxConcurrent => {
                if circuit_opened_since(&fleet, started).await? {
                    violations.push(Violation::Missing {
                        what: "the breaker opened under maxUnhealthy 100%".into(),
                    });
                }
            }
        }
        row.add_trial(&expect, violations);
    }
    fleet.add_notes(&mut row);
    Ok(row)
}

/// Whether the policy's `CircuitOpen` condition is True, or changed
/// (opened and closed again) since `since`.
async fn circuit_opened_since(fleet: &Fleet, since: k8s_openapi::jiff::Timestamp) -> Result<bool> {
    let policies: Api<GpuHealthPolicy> = Api::all(fleet.s.client.clone());
    let policy = policies.get(&fleet.s.policy).await?;
    Ok(policy.status.is_some_and(|s| {
        s.conditions.iter().any(|c| {
            c.type_ == "CircuitOpen" && (c.status == "True" || c.last_transition_time.0 >= since)
        })
    }))
}

/// Whether the policy's `CircuitOpen` condition turns True.
async fn circuit_opened(fleet: &Fleet) -> bool {
    let policies: Api<GpuHealthPolicy> = Api::all(fleet.s.client.clone());
    until(policies, &fleet.s.policy, SETTLE, |p| {
        p.status.as_ref().is_some_and(|s| {
            s.conditions
                .iter()
                .any(|c| c.type_ == "CircuitOpen" && c.status == "True")
        })
    })
    .await
    .is_ok()
}

/// Whether `node` has been anything but Healthy in `timeline`: a node
/// remediated quickly may be back before the others are taken in.
fn taken_in(timeline: &[Seen], node: &str) -> bool {
    timeline.iter().any(|s| {
        matches!(s, Seen::Health { node: n, phase, .. } if n == node && *phase != Phase::Healthy)
    })
}

/// The sick nodes held back (`Suspect`: the breaker or the budget).
fn held_back(timeline: &[Seen], sick: &[String]) -> Vec<String> {
    sick.iter()
        .filter(|n| latest_phase(timeline, n) == Some(Phase::Suspect))
        .cloned()
        .collect()
}
