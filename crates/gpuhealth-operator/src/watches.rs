//! The operator's watches of the cluster, and the streams of changes each
//! feeds the controllers: the records it reads before it leads, and the
//! fleet's nodes and disruption budgets it watches once it does.

use futures::{
    StreamExt,
    channel::mpsc::{UnboundedReceiver, unbounded},
};
use gpuhealth_api::{GpuHealthPolicy, GpuNodeHealth};
use k8s_openapi::api::{core::v1::Node, policy::v1::PodDisruptionBudget};
use kube::{
    Api, Client, ResourceExt,
    runtime::{
        Controller, WatchStreamExt, controller,
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};

use crate::{slim, triggers};

/// Node reconciles in flight at most. Unbounded, a start on a fleet ran one
/// per node at once: at 1,000 nodes they left the operator 84 MiB at rest
/// where it needs 34, and at 5,000 their requests delayed the leader's
/// renewal past its deadline, so it exited (bench/FINDINGS.md). A
/// reconcile is a few store reads and at most a few writes: 32 at once go
/// through a fleet's start in seconds and a storm's nodes at once.
const RECONCILES_AT_ONCE: u16 = 32;

/// The watches of one object per node list in pages of this many: a page is
/// parsed whole, and pages of 500 nodes made a start's peak (bench/FINDINGS.md).
fn fleet_watch() -> watcher::Config {
    watcher::Config::default().page_size(100)
}

/// What every replica reads before it leads, so that a new leader starts
/// warm. The policies' controller keeps a watch of its own (kube's stable
/// API cannot share one stream); the health records' watch also triggers
/// reconciles, once this replica leads.
pub struct Records {
    pub policies: Store<GpuHealthPolicy>,
    pub node_health: Store<GpuNodeHealth>,
    /// What the cached records leave out: their per-GPU tables, as hashes.
    pub gpu_tables: slim::GpuTables,
    /// The nodes' and policies' reconciles follow this one watch of the
    /// health records (`triggers`).
    pub health_changes: triggers::HealthChanges,
    /// Every node is looked at again when a policy's spec changes.
    pub spec_changes: triggers::SpecChanges,
}

/// Starts the policies' and health records' watches; returns once both
/// have listed.
pub async fn records(client: &Client) -> Result<Records, kube::Error> {
    let (policies, policy_writer) = reflector::store::<GpuHealthPolicy>();
    let (node_health, health_writer) = reflector::store::<GpuNodeHealth>();
    // The changes are read after the stores have taken them in: the
    // reconciles they start read those stores.
    let spec_changes = triggers::SpecChanges::default();
    tokio::spawn(
        watcher(
            Api::<GpuHealthPolicy>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .reflect(policy_writer)
        .inspect(spec_changes.tap(policies.clone()))
        .for_each(|_| futures::future::ready(())),
    );
    let health_changes = triggers::HealthChanges::default();
    let gpu_tables = slim::GpuTables::default();
    tokio::spawn(
        watcher(Api::<GpuNodeHealth>::all(client.clone()), fleet_watch())
            .default_backoff()
            .modify(gpu_tables.slimmer())
            .reflect(health_writer)
            .inspect(health_changes.tap())
            .for_each(|_| futures::future::ready(())),
    );
    let listed = |e| kube::Error::Service(Box::new(e));
    policies.wait_until_ready().await.map_err(listed)?;
    node_health.wait_until_ready().await.map_err(listed)?;
    Ok(Records {
        policies,
        node_health,
        gpu_tables,
        health_changes,
        spec_changes,
    })
}

/// The fleet's nodes and disruption budgets, watched once this replica
/// leads, and the changes they feed the controllers.
pub struct Fleet {
    pub nodes: Store<Node>,
    /// The nodes' controller over the slimmed node watch.
    pub controller: Controller<Node>,
    /// A node's labels changed: every policy's selection is looked at again.
    pub label_changes: UnboundedReceiver<()>,
    /// A node was deleted: the records of deleted nodes are swept.
    pub deletions: UnboundedReceiver<()>,
    pub budgets: Store<PodDisruptionBudget>,
    /// The nodes whose DryRun plan a changed budget is in.
    pub budget_changes: UnboundedReceiver<ObjectRef<Node>>,
}

/// Nodes are kept slim, and only a change in what a reconcile reads
/// triggers one: at fleet scale whole nodes were most of the memory.
/// PodDisruptionBudgets are kept from one watch.
pub fn fleet(client: &Client, node_health: Store<GpuNodeHealth>) -> Fleet {
    let (nodes, node_writer) = reflector::store::<Node>();
    let (relabelled, label_changes) = unbounded();
    let (deleted, deletions) = unbounded();
    let (labels_before, labels_after) = triggers::label_changes(nodes.clone(), relabelled);
    let node_changes = watcher(Api::<Node>::all(client.clone()), fleet_watch())
        .default_backoff()
        .modify(slim::node)
        .inspect(labels_before)
        .reflect(node_writer)
        // After the store has the change: the reconciles and the sweep
        // they start read it.
        .inspect(labels_after)
        .inspect(triggers::deletions(deleted))
        .applied_objects()
        .predicate_filter(slim::node_inputs, Default::default());
    let controller = Controller::for_stream(node_changes, nodes.clone())
        .with_config(controller::Config::default().concurrency(RECONCILES_AT_ONCE));
    let (budgets, budget_writer) = reflector::store::<PodDisruptionBudget>();
    let (budget_changed, budget_changes) = unbounded();
    let planned = planned_in(node_health);
    tokio::spawn(
        watcher(
            Api::<PodDisruptionBudget>::all(client.clone()),
            watcher::Config::default(),
        )
        .default_backoff()
        .modify(|pdb| pdb.managed_fields_mut().clear())
        .reflect(budget_writer)
        .applied_objects()
        .for_each(move |pdb| {
            for node in pdb.map(&planned).unwrap_or_default() {
                let _ = budget_changed.unbounded_send(node);
            }
            futures::future::ready(())
        }),
    );
    Fleet {
        nodes,
        controller,
        label_changes,
        deletions,
        budgets,
        budget_changes,
    }
}

/// The nodes whose DryRun plan has pods in a budget's namespace: a
/// budget's change is in their plan at once, not at the next poll (a
/// drain looks again every two seconds anyway).
fn planned_in(
    statuses: Store<GpuNodeHealth>,
) -> impl Fn(PodDisruptionBudget) -> Vec<ObjectRef<Node>> {
    move |pdb: PodDisruptionBudget| {
        let namespace = pdb.namespace().unwrap_or_default();
        statuses
            .state()
            .iter()
            .filter(|g| {
                g.status.as_ref().is_some_and(|s| {
                    s.plan
                        .iter()
                        .flat_map(|p| p.evict.iter().chain(&p.wait_for))
                        .any(|pod| pod.namespace == namespace)
                })
            })
            .map(|g| ObjectRef::new(&g.name_any()))
            .collect()
    }
}
