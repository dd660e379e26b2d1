//! Newcomers on a fenced GPU: per-GPU incidents on DRA nodes in which a pod
//! comes to hold the bad GPU after it was judged bad, in the two windows a
//! scheduler has to give it out:
//!
//! - **before the rule**: the fault is put on the hardware while the leader
//!   is stalled (SIGSTOP, as a replica starved of CPU would be), and a pod
//!   that can only have that GPU is created: the real scheduler allocates
//!   it the device, which nothing fences yet;
//! - **the rule deleted mid-incident**: once the reset is requested (it
//!   runs for seconds here, as a real one does), the rule is deleted by an
//!   identity allowed to (the run's own, an admin's) while the leader is
//!   stalled, and the same kind of pod is given the device.
//!
//! The leader goes on well within its renew deadline. The checker judges
//! that no request is written, and none carried out, while the newcomer
//! holds the GPU (`RequestWhileHeld`, `CarriedOutWhileHeld`, from its
//! ResourceClaim), that its eviction is in the drain's scope, and that no
//! rule outlives its incident. The row says how often the scheduler gave a
//! newcomer the bad GPU: a trial whose window was missed judges nothing
//! about newcomers.

use std::{path::Path, time::Duration};

use gpuhealth_api::{GpuHealth, quarantine::RULE_NODE_LABEL};
use k8s_openapi::{
    api::{
        core::v1::{Node, Pod},
        resource::v1::ResourceClaim,
    },
    apimachinery::pkg::util::intstr::IntOrString,
};
use kube::{
    Api,
    api::{DeleteParams, ListParams},
};

use super::{Fault, Rng, Row, fleet::Fleet, policy, update_hardware};
use crate::{
    Result,
    dra::{self, allocated_device},
    invariants::{Seen, ending},
    node_agent::hardware,
    operator::Options,
    wait::until,
};

/// The two windows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Window {
    BeforeRule,
    RuleDeleted,
}

/// How long the leader stays stalled at most: well inside its renew
/// deadline (4 s), so that it leads on.
const STALL: Duration = Duration::from_secs(2);

/// How long a simulated reset runs here: a window for a newcomer while a
/// request is in flight.
const RESET_TAKES: Duration = Duration::from_secs(6);

/// `trials` incidents, the windows in turn, under the operator `binary`
/// (this build's by default; an older one shows what the checker catches).
pub async fn run(trials: usize, binary: Option<&Path>, rng: &mut Rng) -> Result<Row> {
    let spec = policy(2, IntOrString::String("100%".into()));
    let options = Options {
        binary: binary.map(Path::to_path_buf),
        ..Options::default()
    };
    let mut fleet = Fleet::with_options("chaos-newcomer", 4, spec, 2, options).await?;
    fleet.s.publish_devices().await?;
    for node in &fleet.s.nodes {
        update_hardware(&fleet.s.client, node, |hw| {
            hw.reset_takes = Some(gpuhealth_api::Duration::from_secs(RESET_TAKES.as_secs()));
        })
        .await?;
    }
    let mut row = Row::new("newcomers on a fenced GPU");
    // Per window: trials, and those in which the newcomer got the bad GPU.
    let mut given = [(0, 0); 2];
    for t in 0..trials {
        let window = if t % 2 == 0 {
            Window::BeforeRule
        } else {
            Window::RuleDeleted
        };
        let newcomer = format!("newcomer-{t}");
        let stalled = match window {
            Window::BeforeRule => Some(fleet.stall_leader().await?),
            Window::RuleDeleted => None,
        };
        let mut got = false;
        // A reset that heals keeps the GPU fenced alone throughout: only
        // holders watched catch a newcomer then (a failed one widens to a
        // cordon and a drain of the node).
        let kinds: &[Fault] = match window {
            Window::BeforeRule => &[Fault::ResetHeals, Fault::RebootHeals],
            Window::RuleDeleted => &[Fault::ResetHeals],
        };
        let (expect, violations) = fleet
            .trial(rng, 1, kinds, async |fleet, _rng| {
                got = arrive(fleet, window, stalled, &newcomer).await?;
                Ok(Vec::new())
            })
            .await?;
        let tally = &mut given[window as usize];
        tally.0 += 1;
        tally.1 += usize::from(got);
        eprintln!("chaos: {window:?}: the newcomer was given the bad GPU: {got}");
        remove(&fleet, &newcomer).await?;
        row.add_trial(&expect, violations);
    }
    row.notes.push(format!(
        "the scheduler gave the newcomer the bad GPU in {}/{} trials before its rule existed and {}/{} with the rule deleted while the reset ran ({} s)",
        given[0].1,
        given[0].0,
        given[1].1,
        given[1].0,
        RESET_TAKES.as_secs()
    ));
    fleet.add_notes(&mut row);
    Ok(row)
}

/// Opens `window` on the trial's sick node and sends in `newcomer`, a pod
/// that can only have the bad GPU; lets the leader go on. Whether the
/// scheduler gave it the bad GPU.
async fn arrive(
    fleet: &mut Fleet,
    window: Window,
    stalled: Option<String>,
    newcomer: &str,
) -> Result<bool> {
    let node = fleet.trial_sick[0].clone();
    let gpu = bad_gpu(fleet, &node).await?;
    let stalled = match (window, stalled) {
        (Window::BeforeRule, stalled) => stalled,
        (Window::RuleDeleted, _) => {
            let mark = fleet.trial_mark;
            fleet
                .recorder
                .until(mark, "the reset requested", super::fleet::SETTLE, |t| {
                    ending(t, &node).is_some()
                        || t.iter()
                            .any(|s| matches!(s, Seen::Request { node: n, .. } if *n == node))
                })
                .await?;
            let leader = fleet.stall_leader().await?;
            let rules = dra::rules(&fleet.s.client).await?;
            let of_node = ListParams::default().labels(&format!("{RULE_NODE_LABEL}={node}"));
            rules
                .delete_collection(&DeleteParams::default(), &of_node)
                .await?;
            Some(leader)
        }
    };
    let s = &fleet.s;
    let arrived = async {
        dra::claiming_pod_on(&s.client, &s.namespace, &node, newcomer, Some(gpu)).await?;
        let claims: Api<ResourceClaim> = Api::namespaced(s.client.clone(), &s.namespace);
        let claim = until(claims, &format!("{newcomer}-gpu"), STALL, |c| {
            allocated_device(c).is_some()
        })
        .await;
        Ok::<_, crate::HarnessError>(
            claim.is_ok_and(|c| allocated_device(&c) == Some(dra::device_name(gpu))),
        )
    }
    .await;
    // Whatever happened, the leader goes on.
    if let Some(leader) = stalled {
        fleet.resume(&leader).await?;
    }
    arrived
}

/// The index of `node`'s bad GPU.
async fn bad_gpu(fleet: &Fleet, node: &str) -> Result<u32> {
    let current = Api::<Node>::all(fleet.s.client.clone()).get(node).await?;
    hardware(&current)
        .and_then(|hw| hw.gpus.into_iter().find(|g| g.health != GpuHealth::Healthy))
        .map(|g| g.index)
        .ok_or_else(|| crate::HarnessError::ClusterStart(format!("{node} has no bad GPU")))
}

/// Deletes `newcomer` and its claim, wherever they are: the run's own
/// deletion, not an eviction.
async fn remove(fleet: &Fleet, newcomer: &str) -> Result<()> {
    let s = &fleet.s;
    let now = DeleteParams::default().grace_period(0);
    let gone = |r: std::result::Result<_, kube::Error>| match r {
        Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
        r => r.map(|_| ()),
    };
    gone(
        Api::<Pod>::namespaced(s.client.clone(), &s.namespace)
            .delete(newcomer, &now)
            .await
            .map(|_| ()),
    )?;
    gone(
        Api::<ResourceClaim>::namespaced(s.client.clone(), &s.namespace)
            .delete(&format!("{newcomer}-gpu"), &now)
            .await
            .map(|_| ()),
    )?;
    Ok(())
}
