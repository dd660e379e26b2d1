//! One node's reconcile: read the world, let the engine decide, record the
//! decision, then carry it out.

use std::{
    collections::{BTreeSet, HashMap, HashSet},
    sync::Arc,
    time::Duration,
};

use gpuhealth_api::{
    GpuHealthPolicy, GpuNodeHealth,
    node_health::{GpuNodeHealthStatus, Phase},
    policy::Mode,
    vocabulary::Reason,
};
use gpuhealth_engine::{
    budget::{Budget, unhealthy},
    machine::{Input, is_disruptive, step, validation_pod_name, workloads_to_watch},
};
use k8s_openapi::{
    api::{
        core::v1::{Node, Pod},
        policy::v1::PodDisruptionBudget,
    },
    jiff::Timestamp,
};
use kube::{
    Api, Resource, ResourceExt,
    api::{ListParams, Patch, PatchParams},
    runtime::{controller::Action as Requeue, reflector::ObjectRef},
};
use serde_json::json;
use tracing::{debug, info, warn};

use crate::{
    account, actions,
    context::{Context, Error, HoldersSeen, MANAGER, latest},
    metrics::ErrorLabels,
    observe::{budget_views, disrupted_by, gpu_holders, holders_hash, node_view, pod_view},
    policy_status::policy_nodes,
    selection::winner,
    validation, workloads,
};

/// How long after a takeover remediation starts are confirmed against a
/// fresh list: the previous leader's last writes reach this replica's
/// watch within seconds (seven, at worst, in the chaos runs on two loaded
/// cores); a minute leaves a wide margin.
const FRESH_BUDGET_AFTER_TAKEOVER: Duration = Duration::from_secs(60);

pub async fn reconcile(node: Arc<Node>, ctx: Arc<Context>) -> Result<Requeue, Error> {
    let started = std::time::Instant::now();
    let result = reconcile_node(&node, &ctx).await;
    ctx.metrics
        .reconcile_duration
        .observe(started.elapsed().as_secs_f64());
    result
}

async fn reconcile_node(node: &Node, ctx: &Context) -> Result<Requeue, Error> {
    if !ctx.leadership.is_held() {
        return Err(Error::NotLeader);
    }
    let started = std::time::Instant::now();
    let policies = ctx.policies.state();
    let Some(policy) = winner(&policies, node) else {
        return Ok(Requeue::await_change());
    };
    let name = node.name_any();
    let policy_name = policy.name_any();
    let mut view = node_view(node, &policy.spec.other_actors, &ctx.locks.of(&name));
    view.report_refreshed_at = report_refreshed_at(ctx, &name, &view);
    if let Some(Err(e)) = &view.report {
        warn!(node = %name, error = %e, "malformed GPU report; ignoring it");
    }

    // What this process decided last for the node, which the watch-fed
    // store may not show yet. A node is never reconciled twice at once, so
    // its record cannot change before this reconcile makes its own.
    let in_cluster = ctx
        .node_health
        .get(&ObjectRef::new(&name))
        .and_then(|g| g.status.clone());
    let recorded = ctx.lock_decisions().get(&name).cloned();
    let stored = recorded.clone().or(in_cluster.clone()).unwrap_or_default();
    // Pods are listed only for a node under remediation or with a bad GPU,
    // or when the pods holding its GPUs change (a readiness gate may need
    // setting), so memory follows the work in flight rather than the size
    // of the cluster. Under Enforce a healthy node newly reporting a bad GPU
    // is quarantined on the report alone: its pods matter then only for
    // their readiness gates, which the next reconcile, a second later at
    // most, sets before any eviction. One round trip fewer before the
    // cordon (the benchmark's time to quarantine).
    let has_bad_gpu = matches!(&view.report, Some(Ok(r)) if r.bad_gpus().next().is_some());
    let holders = gpu_holders(&view);
    let holders_now = HoldersSeen::Holders(holders_hash(&holders));
    let seen = ctx
        .holders_seen
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&name)
        .copied();
    let gates_later = has_bad_gpu
        && stored.phase == Phase::Healthy
        && policy.spec.mode == Mode::Enforce
        && seen != Some(HoldersSeen::GatesPending);
    let list_pods = stored.phase != Phase::Healthy || has_bad_gpu || seen != Some(holders_now);
    let pods = if list_pods && !gates_later {
        let api: Api<Pod> = Api::all(ctx.client.clone());
        let list = api
            .list(&ListParams::default().fields(&format!("spec.nodeName={name}")))
            .await?;
        list.items.iter().map(|p| pod_view(p, &holders)).collect()
    } else {
        Vec::new()
    };

    // What the budgets allow goes into a DryRun plan; when acting, the
    // Eviction API applies them.
    let disruption_budgets = if policy.spec.mode == Mode::DryRun && !pods.is_empty() {
        let namespaces: BTreeSet<&str> = pods.iter().map(|p| p.namespace.as_str()).collect();
        let mut pdbs = Vec::new();
        for ns in namespaces {
            let api: Api<PodDisruptionBudget> = Api::namespaced(ctx.client.clone(), ns);
            pdbs.extend(api.list(&ListParams::default()).await?.items);
        }
        budget_views(&pdbs, &pods)
    } else {
        Vec::new()
    };
    let watched = workloads_to_watch(&stored);
    let workload_views = if watched.is_empty() {
        Vec::new()
    } else {
        workloads::watched(ctx, &watched).await?
    };
    let validation = match (&policy.spec.verification.validation_pod, &stored.action) {
        (Some(_), Some(action)) if stored.phase == Phase::Verifying => {
            let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &ctx.validation.namespace);
            api.get_opt(&validation_pod_name(&name, &action.id))
                .await?
                .map(|p| validation::view(&p))
        }
        _ => None,
    };
    // The reads above are done without the lock, so that one node's API
    // calls never hold up another's decision. Deciding and recording are
    // one step under it: each budget counts every other node's latest
    // intent, written or about to be.
    let fleet = Fleet::of(ctx, &policy, &name);
    let waiting = ctx.metrics.stage("read", started);
    let decision = {
        let mut written = ctx.lock_decisions();
        let deciding = ctx.metrics.stage("wait", waiting);
        let budget = fleet.budget(ctx, &written, &policy, &name);
        let decision = step(&Input {
            now: Timestamp::now(),
            policy: &policy_name,
            spec: &policy.spec,
            node: &view,
            pods: &pods,
            disruption_budgets: &disruption_budgets,
            validation: validation.as_ref(),
            workloads: &workload_views,
            budget,
            state: &stored,
        });
        // A record bridges the time until the watch shows this process's
        // last write. None is kept once the cluster shows it and nothing new
        // is to be written, so that the records follow the work in flight,
        // not the size of the fleet.
        let caught_up = recorded.is_none() || recorded == in_cluster;
        if caught_up && in_cluster.as_ref() == Some(&decision.status) {
            written.remove(&name);
        } else {
            written.insert(name.clone(), decision.status.clone());
        }
        ctx.metrics.stage("decide", deciding);
        decision
    };

    // Starting a remediation takes from the budget, and the budget above
    // was counted from this process's cache and its own records: a replica
    // that has just taken over may not yet have seen the last writes of the
    // leader before it (the chaos runs saw a third node started under
    // maxConcurrent 2 right after a takeover, its view seven seconds old).
    // Its own writes it always counts, and the leader is the only writer,
    // so only the first while after a takeover is at risk: a start then is
    // confirmed against a fresh list from the API server first (one LIST of
    // every GpuNodeHealth, too heavy for every start of a large fleet: the
    // benchmark's time to quarantine quadrupled). Until it is written, the
    // record above already counts it for every other decision.
    let starts = policy.spec.mode == Mode::Enforce
        && !is_disruptive(stored.phase)
        && is_disruptive(decision.status.phase);
    let new_leader = ctx
        .leadership
        .held_for()
        .is_some_and(|d| d < FRESH_BUDGET_AFTER_TAKEOVER);
    if starts && new_leader {
        let fresh = Api::<GpuNodeHealth>::all(ctx.client.clone())
            .list(&ListParams::default())
            .await;
        let held = fresh.map(|list| {
            let store: Vec<Arc<GpuNodeHealth>> = list.items.into_iter().map(Arc::new).collect();
            let written = ctx.lock_decisions();
            fleet
                .budget_from(&store, &written, &policy, &name)
                .may_start()
                .err()
        });
        if !matches!(held, Ok(None)) {
            let mut records = ctx.lock_decisions();
            match recorded {
                Some(before) => records.insert(name.clone(), before),
                None => records.remove(&name),
            };
            return match held {
                Ok(hold) => {
                    info!(node = %name, policy = %policy_name, ?hold, "not starting: the API server shows less budget than the cache did");
                    Ok(Requeue::requeue(Duration::from_secs(2)))
                }
                Err(e) => Err(e.into()),
            };
        }
    }

    // Intent first: the status is written before any side effect. If it
    // cannot be, the record goes back to what it was: other decisions made
    // meanwhile counted an intent that did not happen, which errs on the
    // safe side.
    let written = if !ctx.leadership.is_held() {
        Err(Error::NotLeader)
    } else if in_cluster.as_ref() != Some(&decision.status) {
        let writing = std::time::Instant::now();
        let result = write_status(ctx, node, &decision.status).await;
        ctx.metrics.stage("write", writing);
        result
    } else {
        Ok(())
    };
    let acting = std::time::Instant::now();
    if let Err(e) = written {
        let mut records = ctx.lock_decisions();
        match recorded {
            Some(before) => records.insert(name.clone(), before),
            None => records.remove(&name),
        };
        return Err(e);
    }
    account::count(ctx, &policy_name, &view, &decision.happenings);
    let phase = decision.status.phase;
    let crash_here = ctx
        .crash_after
        .as_ref()
        .is_some_and(|(at, only)| *at == phase && only.as_ref().is_none_or(|n| *n == name));
    if crash_here && stored.phase != phase {
        tracing::error!(node = %name, ?phase, "GPUHEALTH_TEST_CRASH_AFTER: exiting before carrying out the actions");
        std::process::exit(3);
    }

    // One line per transition, with what an SRE greps for.
    if stored.phase != decision.status.phase || stored.reason != decision.status.reason {
        let st = &decision.status;
        info!(
            node = %name,
            policy = %policy_name,
            from = ?stored.phase,
            phase = ?st.phase,
            reason = st.reason.map_or("", Reason::as_str),
            action = st.action.as_ref().map(|a| format!("{:?}#{}", a.type_, a.attempt)).unwrap_or_default(),
            incident = st.incident.as_deref().or(st.history.first().map(|i| i.id.as_str())).unwrap_or(""),
            // Not `message`: that is the event's own text in JSON logs.
            detail = st.message.as_deref().unwrap_or(""),
            "transition"
        );
    }
    debug!(
        node = %name,
        phase = ?decision.status.phase,
        reason = decision.status.reason.map_or("", Reason::as_str),
        requeue = ?decision.requeue_after,
        "decided"
    );
    for action in &decision.actions {
        if !ctx.leadership.is_held() {
            return Err(Error::NotLeader);
        }
        debug!(node = %name, ?action, "carrying out");
        actions::run(ctx, node, &policy.spec, action).await?;
    }
    if !decision.actions.is_empty() {
        ctx.metrics.stage("act", acting);
    }
    account::tell(ctx, node, &decision.happenings).await;
    let seen_now = if gates_later {
        HoldersSeen::GatesPending
    } else {
        holders_now
    };
    ctx.holders_seen
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(name, seen_now);
    if gates_later {
        return Ok(Requeue::requeue(Duration::from_secs(1)));
    }
    Ok(match decision.requeue_after {
        Some(after) => Requeue::requeue(after.max(Duration::from_secs(1))),
        None => Requeue::requeue(Duration::from_secs(300)),
    })
}

/// When this process first saw the node's report as it is now (its
/// `observedAt`), by its own clock.
fn report_refreshed_at(
    ctx: &Context,
    node: &str,
    view: &gpuhealth_engine::machine::NodeView,
) -> Option<k8s_openapi::jiff::Timestamp> {
    let Some(Ok(report)) = &view.report else {
        return None;
    };
    let observed = report.observed_at.0;
    let mut seen = ctx.report_seen.lock().unwrap_or_else(|e| e.into_inner());
    let entry = seen
        .entry(node.to_owned())
        .or_insert((observed, k8s_openapi::jiff::Timestamp::now()));
    if entry.0 != observed {
        *entry = (observed, k8s_openapi::jiff::Timestamp::now());
    }
    Some(entry.1)
}

/// What a policy's budget needs from the node store: gathered before the
/// decisions lock, since it reads only the watch-fed nodes and other tools'
/// locks. A pass over every node under the lock made each decision wait for
/// all the others' passes (the benchmark: seconds at 1,000 nodes).
struct Fleet {
    managed: usize,
    /// Managed nodes, other than this one, that other tools are disrupting.
    disrupted_by_others: Vec<String>,
}

impl Fleet {
    fn of(ctx: &Context, policy: &GpuHealthPolicy, this: &str) -> Fleet {
        let managed = policy_nodes(ctx, policy);
        let disrupted_by_others = managed
            .iter()
            .filter_map(|n| n.metadata.name.as_deref().map(|name| (n, name)))
            .filter(|(_, name)| *name != this)
            .filter(|(n, name)| {
                !disrupted_by(n, &policy.spec.other_actors, &ctx.locks.of(name)).is_empty()
            })
            .map(|(_, name)| name.to_owned())
            .collect();
        Fleet {
            managed: managed.len(),
            disrupted_by_others,
        }
    }

    /// The budget, from every other node's latest status (`written`: this
    /// process's records, under the decisions lock), in one pass.
    fn budget(
        &self,
        ctx: &Context,
        written: &HashMap<String, GpuNodeHealthStatus>,
        policy: &GpuHealthPolicy,
        this: &str,
    ) -> Budget {
        self.budget_from(&ctx.node_health.state(), written, policy, this)
    }

    /// The budget, from `store`'s statuses (the cache's, or a fresh list's)
    /// and this process's records.
    fn budget_from(
        &self,
        store: &[Arc<GpuNodeHealth>],
        written: &HashMap<String, GpuNodeHealthStatus>,
        policy: &GpuHealthPolicy,
        this: &str,
    ) -> Budget {
        let policy_name = policy.metadata.name.as_deref();
        let mut disruptive: HashSet<&str> = HashSet::new();
        let mut sick = 0;
        for (name, status) in latest(store, written)
            .filter(|(name, s)| *name != this && s.policy.as_deref() == policy_name)
        {
            if is_disruptive(status.phase) {
                disruptive.insert(name);
            }
            sick += usize::from(unhealthy(status));
        }
        // Nodes other tools are disrupting take capacity out too, unless
        // gpuhealth already counts them.
        let by_others = self
            .disrupted_by_others
            .iter()
            .filter(|n| !disruptive.contains(n.as_str()))
            .count();
        // This node counts itself only when it wants to start, which is the
        // only time the engine consults the breaker.
        Budget::new(&policy.spec, self.managed, disruptive.len(), sick + 1).with_others(by_others)
    }
}

async fn write_status(
    ctx: &Context,
    node: &Node,
    status: &GpuNodeHealthStatus,
) -> Result<(), Error> {
    let api: Api<GpuNodeHealth> = Api::all(ctx.client.clone());
    let name = node.name_any();
    let params = PatchParams::apply(MANAGER).force();
    if ctx.node_health.get(&ObjectRef::new(&name)).is_none() {
        // One GpuNodeHealth per node, named after it and owned by it, so it
        // goes when the node goes.
        let owner = node.controller_owner_ref(&()).map(|mut o| {
            o.controller = Some(false);
            o
        });
        let object = json!({
            "apiVersion": "gpuhealth.io/v1alpha1",
            "kind": "GpuNodeHealth",
            "metadata": {"name": name, "ownerReferences": owner.into_iter().collect::<Vec<_>>()},
            "spec": {},
        });
        api.patch(&name, &params, &Patch::Apply(object)).await?;
    }
    let patch =
        json!({"apiVersion": "gpuhealth.io/v1alpha1", "kind": "GpuNodeHealth", "status": status});
    api.patch_status(&name, &params, &Patch::Apply(patch))
        .await?;
    Ok(())
}

pub fn error_policy(node: Arc<Node>, error: &Error, ctx: Arc<Context>) -> Requeue {
    retry(&node.name_any(), "node", error, &ctx)
}

/// Counts a failed reconcile and retries it shortly.
pub fn retry(name: &str, what: &str, error: &Error, ctx: &Context) -> Requeue {
    let kind = error.metric_label();
    ctx.metrics
        .reconcile_errors
        .get_or_create(&ErrorLabels { kind: kind.into() })
        .inc();
    match error {
        // Expected on a standby replica, or for the moment after losing the lease.
        Error::NotLeader => debug!(%name, what, "not the leader; not acting"),
        _ => warn!(%name, what, error = %error, kind, "reconcile failed; retrying"),
    }
    Requeue::requeue(Duration::from_secs(5))
}
