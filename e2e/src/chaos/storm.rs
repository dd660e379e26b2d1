//! Storms: 30 % of the nodes fail at once, beyond the policy's
//! `maxUnhealthy`. The circuit breaker must open (the policy says
//! `CircuitOpen`), no more than `maxConcurrent` nodes may be disrupted
//! meanwhile, and once the faults clear on the nodes it held back (a bad
//! driver rolled back) every node must be back in service.

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
    invariants::{Seen, Violation, latest_phase},
    wait::until,
};

const NODES: usize = 10;

pub async fn run(trials: usize, rng: &mut Rng) -> Result<Row> {
    // Two may be remediated at once; more than two unhealthy is a storm.
    let spec = policy(2, IntOrString::String("20%".into()));
    let mut fleet = Fleet::new("chaos-storm", NODES, spec, 2).await?;
    let mut row = Row::new("storm: 30% of nodes at once");
    for _ in 0..trials {
        let (expect, violations) = fleet
            .trial(
                rng,
                NODES * 3 / 10,
                &[Fault::ResetHeals],
                async |fleet, _| {
                    let opened = circuit_opened(fleet).await;
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
                    Ok(if opened {
                        Vec::new()
                    } else {
                        vec![Violation::Missing {
                            what: "the policy never said CircuitOpen".into(),
                        }]
                    })
                },
            )
            .await?;
        row.add_trial(&expect, violations);
    }
    fleet.note_exits(&mut row);
    Ok(row)
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
