//! The second stage: the engine's step, under the lock that orders all
//! decisions, so that each budget counts every other node's latest intent,
//! written or about to be. No I/O here: the reads were done without the
//! lock, so that one node's API calls never hold up another's decision.

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::Instant,
};

use gpuhealth_api::{
    GpuHealthPolicy, GpuNodeHealth, node_health::GpuNodeHealthStatus, policy::GpuHealthPolicySpec,
    vocabulary::Reason,
};
use gpuhealth_engine::{
    budget::{self, Budget},
    honour,
    machine::{BudgetNeeded, Decision, Input, NotEnforced, is_disruptive, record_not_ours, step},
};
use k8s_openapi::jiff::Timestamp;
use kube::runtime::reflector::ObjectRef;
use tracing::warn;

use super::{pending::Pending, read::Read};
use crate::{
    context::{Context, latest},
    fences::node_of,
    observe::{carries_our_cordon, disrupted_by},
    selection::managed_by,
};

/// The step's decision, and this process's record of it (see [`Pending`]).
pub struct Decided<'a> {
    pub decision: Decision,
    pub pending: Pending<'a>,
}

pub fn decide<'a>(ctx: &'a Context, read: &Read, waiting: Instant) -> Decided<'a> {
    let spec = &read.policy.spec;
    // The policy's last count of its nodes; a step about to start a
    // remediation counts them afresh (below).
    let selected = read.policy.status.as_ref().map_or(0, |s| s.nodes as usize);
    let unprotected = ctx.protection.missing();
    let past = past_guardrails(ctx, spec, selected);
    let input = |budget, not_enforced| Input {
        now: Timestamp::now(),
        policy: &read.policy_name,
        spec: &read.policy.spec,
        node: &read.view,
        pods: &read.pods,
        disruption_budgets: &read.disruption_budgets,
        gangs: &read.gangs,
        gang_windows: &read.gang_windows,
        validation: read.validation.as_ref(),
        workloads: &read.workloads,
        budget,
        state: &read.stored,
        not_enforced,
        guardrails: &ctx.guardrails,
        seal: ctx.seal.check(&read.name, &read.stored),
    };
    let mut written = ctx.lock_decisions();
    let mut deciding = ctx.metrics.stage("wait", waiting);
    // Most steps never look at the budget, and counting it walks the
    // policy's whole fleet: a pass over 5,000 nodes after a policy change
    // held new faults back for half a minute (bench/FINDINGS.md). It is
    // counted only when the step asks, outside the lock, then under it
    // with this process's latest records.
    // A record this operator did not write is carried out in nothing (the
    // engine holds it), and the decision about it is not sealed.
    let not_ours = record_not_ours(&input(None, None));
    if let Some(why) = not_ours {
        warn!(node = %read.name, phase = ?read.stored.phase, %why, "the node's record was not written by this operator: nothing it records is carried out");
    }
    let ours = not_ours.is_none();
    let mut decision = match step(&input(None, not_enforced(&unprotected, &past))) {
        Ok(decision) => decision,
        Err(BudgetNeeded) => {
            drop(written);
            let fleet = Fleet::of(ctx, &read.policy, &read.name);
            let counted = past_guardrails(ctx, spec, fleet.managed);
            written = ctx.lock_decisions();
            deciding = ctx.metrics.stage("budget", deciding);
            let budget = fleet.budget(
                ctx,
                &ctx.node_health.state(),
                &written,
                &read.policy,
                &read.name,
            );
            match step(&input(Some(budget), not_enforced(&unprotected, &counted))) {
                Ok(decision) => decision,
                Err(BudgetNeeded) => unreachable!("a step given its budget does not ask for it"),
            }
        }
    };
    if ours {
        decision.status.seal = ctx.seal.of(&read.name, &decision.status);
    }
    // A record bridges the time until the watch shows this process's last
    // write. None is kept once the cluster shows it and nothing new is to
    // be written, so that the records follow the work in flight, not the
    // size of the fleet.
    let shown = |status: &GpuNodeHealthStatus| {
        read.in_cluster
            .as_ref()
            .is_some_and(|cached| cached.shows(status))
    };
    let caught_up = read.recorded.as_ref().is_none_or(shown);
    // A record held as not the operator's is not one of its decisions:
    // kept in memory, it would outlive its deletion, which is how a person
    // clears it.
    if !ours || (caught_up && shown(&decision.status)) {
        written.remove(&read.name);
    } else {
        written.insert(read.name.clone(), decision.status.clone());
    }
    drop(written);
    ctx.metrics.stage("decide", deciding);
    Decided {
        decision,
        pending: Pending::new(ctx, &read.name, read.recorded.clone()),
    }
}

/// Why nothing of the policy is enforced: the protection first, then the
/// guardrails.
fn not_enforced<'w>(
    unprotected: &'w Option<String>,
    past: &'w Option<String>,
) -> Option<NotEnforced<'w>> {
    match (unprotected, past) {
        (Some(why), _) => Some(NotEnforced {
            reason: Reason::Unprotected,
            why,
        }),
        (None, Some(why)) => Some(NotEnforced {
            reason: Reason::PastGuardrail,
            why,
        }),
        (None, None) => None,
    }
}

/// Where the policy, selecting `selected` nodes, is past the cluster's
/// guardrails, in words; None where it is within them.
fn past_guardrails(ctx: &Context, spec: &GpuHealthPolicySpec, selected: usize) -> Option<String> {
    let past = ctx.guardrails.exceeded(spec, selected);
    honour::message(&past)
}

/// What a policy's budget needs from the node store: gathered before the
/// decisions lock, since it reads only the watch-fed nodes and other tools'
/// locks. A pass over every node under the lock made each decision wait for
/// all the others' passes (the benchmark: seconds at 1,000 nodes).
pub struct Fleet {
    managed: usize,
    /// Managed nodes, other than this one, still carrying gpuhealth's
    /// cordon or device rules.
    still_fenced: Vec<String>,
    /// Managed nodes, other than this one, that other tools are disrupting.
    disrupted_by_others: Vec<String>,
}

impl Fleet {
    /// One pass over the node store: it runs before every remediation's
    /// start, and three passes (the policy's nodes, then its fenced and
    /// its disrupted ones) cost milliseconds at 5,000 nodes.
    pub fn of(ctx: &Context, policy: &GpuHealthPolicy, this: &str) -> Fleet {
        let with_rules: HashSet<String> = ctx
            .dra
            .as_ref()
            .and_then(|dra| dra.rules.as_ref())
            .map(|rules| {
                rules
                    .store
                    .state()
                    .iter()
                    .filter_map(|r| node_of(r))
                    .collect()
            })
            .unwrap_or_default();
        let mut fleet = Fleet {
            managed: 0,
            still_fenced: Vec::new(),
            disrupted_by_others: Vec::new(),
        };
        let nodes = ctx.nodes.state();
        for node in managed_by(ctx, policy, &nodes) {
            fleet.managed += 1;
            let Some(name) = node.metadata.name.as_deref().filter(|n| *n != this) else {
                continue;
            };
            if carries_our_cordon(node) || with_rules.contains(name) {
                fleet.still_fenced.push(name.to_owned());
            }
            if !disrupted_by(node, &policy.spec.other_actors, &ctx.locks.of(name)).is_empty() {
                fleet.disrupted_by_others.push(name.to_owned());
            }
        }
        fleet
    }

    /// The budget of `this` node, from `store`'s statuses (the cache's, or a
    /// fresh list's) and this process's records (`written`), counted by the
    /// engine.
    pub fn budget(
        &self,
        ctx: &Context,
        store: &[Arc<GpuNodeHealth>],
        written: &HashMap<String, GpuNodeHealthStatus>,
        policy: &GpuHealthPolicy,
        this: &str,
    ) -> Budget {
        let policy_name = policy.metadata.name.as_deref();
        let others = latest(store, written)
            .filter(|(name, s)| *name != this && s.policy.as_deref() == policy_name);
        // The cluster's bound counts every policy's nodes that are still
        // there (a deleted node's record waits for `gone` a moment).
        let (mut all, mut disrupted) = (0, 0);
        for (name, status) in latest(store, written) {
            if ctx.nodes.get(&ObjectRef::new(name)).is_none() {
                continue;
            }
            all += 1;
            disrupted += usize::from(name != this && is_disruptive(status.phase));
        }
        let fleet = budget::Fleet::count(others);
        fleet
            .budget_for_one_more(
                &policy.spec,
                self.managed,
                &self.still_fenced,
                &self.disrupted_by_others,
            )
            .across_policies(disrupted, ctx.guardrails.max_disrupted(all))
            .for_node(&fleet, this)
    }
}
