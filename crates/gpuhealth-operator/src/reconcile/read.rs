//! The first stage: what a node's step decides on. The node itself comes
//! from the watch; the engine's `needs` says what else to read, so that
//! reads (and memory) follow the work in flight, not the fleet's size.

use std::{collections::BTreeSet, sync::Arc};

use gpuhealth_api::{
    GpuHealthPolicy, GpuNodeHealth, node_health::GpuNodeHealthStatus, quarantine::Quarantine,
};
use gpuhealth_engine::{
    drain::{BudgetView, PodView},
    fence::DraView,
    gangs::{GangView, GangWindow},
    machine::{HoldersSince, Needs, NodeView, ValidationView, needs},
    workload::WorkloadView,
};
use k8s_openapi::api::{
    core::v1::{Node, Pod},
    policy::v1::PodDisruptionBudget,
};
use kube::{Api, ResourceExt, api::ListParams, runtime::reflector::ObjectRef};
use tracing::warn;

use crate::{
    context::{Context, Error},
    devices, fences, gangs,
    memory::HoldersSeen,
    observe::{
        Beside, budget_views, gpu_holders, holders_hash, node_view, pod_view, resource_count,
    },
    selection::winner,
    slim::CachedStatus,
    validation, watched_workloads,
};

/// Everything a node's step decides on.
pub struct Read {
    pub name: String,
    pub policy: Arc<GpuHealthPolicy>,
    pub policy_name: String,
    pub view: NodeView,
    /// The status the step starts from: this process's last decision for
    /// the node if the watch does not show it yet, else the cluster's.
    pub stored: GpuNodeHealthStatus,
    /// The status as the watch shows it (its per-GPU table as a hash).
    pub in_cluster: Option<CachedStatus>,
    /// This process's record of its last decision, if it keeps one.
    pub recorded: Option<GpuNodeHealthStatus>,
    pub needs: Needs,
    /// The pods holding the node's GPUs now, as a hash.
    holders_now: HoldersSeen,
    pub pods: Vec<PodView>,
    pub disruption_budgets: Vec<BudgetView>,
    pub gangs: Vec<GangView>,
    pub gang_windows: Vec<GangWindow>,
    pub workloads: Vec<WorkloadView>,
    pub validation: Option<ValidationView>,
}

/// Reads what `node`'s step needs; None when no policy manages it.
pub async fn read(ctx: &Context, node: &Node) -> Result<Option<Read>, Error> {
    let policies = ctx.policies.state();
    let name = node.name_any();
    let Some(policy) = winner(&policies, node) else {
        ctx.memory.forget_report(&name);
        return Ok(None);
    };
    let policy_name = policy.name_any();
    let view = node_view(
        node,
        &policy.spec.other_actors,
        &ctx.locks.of(&name),
        beside(ctx, node, &name, &policy.spec.quarantine),
        |observed| ctx.memory.report_first_seen(&name, observed),
    );
    if let Some(Err(e)) = &view.report {
        warn!(node = %name, error = %e, "malformed GPU report; ignoring it");
    }

    // What this process decided last for the node, which the watch-fed
    // store may not show yet. A node is never reconciled twice at once, so
    // its record cannot change before this reconcile makes its own.
    let in_cluster = ctx
        .node_health
        .get(&ObjectRef::new(&name))
        .and_then(|g| g.status.clone())
        .map(|status| CachedStatus {
            status,
            table: ctx.gpu_tables.of(&name),
        });
    let recorded = ctx.lock_decisions().get(&name).cloned();
    let stored = match (&recorded, &in_cluster) {
        (Some(recorded), _) => recorded.clone(),
        // The cache keeps no per-GPU table: a step rebuilds it from the
        // report, and one with no report to read keeps the cluster's. The
        // record itself, not its status subresource: the operator's role
        // may get the one and only patch the other.
        (None, Some(cached)) if !matches!(view.report, Some(Ok(_))) && cached.has_table() => {
            Api::<GpuNodeHealth>::all(ctx.client.clone())
                .get(&name)
                .await
                .map_err(Error::read(&name))?
                .status
                .unwrap_or_default()
        }
        (None, Some(cached)) => cached.status.clone(),
        (None, None) => GpuNodeHealthStatus::default(),
    };

    let holders = gpu_holders(&view);
    let holders_now = HoldersSeen::Holders(holders_hash(&holders));
    let since = match ctx.memory.holders_seen(&name) {
        Some(HoldersSeen::GatesPending) => HoldersSince::GatesPending,
        Some(h) if h == holders_now => HoldersSince::Same,
        _ => HoldersSince::Changed,
    };
    let needs = needs(&policy.spec, &stored, &view, since);

    let pods: Vec<PodView> = if needs.pods {
        let api: Api<Pod> = Api::all(ctx.client.clone());
        let mut items = api
            .list(&ListParams::default().fields(&format!("spec.nodeName={name}")))
            .await
            .map_err(Error::read(&name))?
            .items;
        // A pod holds the GPUs the report names for it and those its
        // ResourceClaims were allocated, from the allocation on: one the
        // scheduler has not bound to the node yet holds its device too.
        let mut held = holders.clone();
        if let (Some(dra), Some(view)) = (&ctx.dra, &view.dra) {
            for (namespace, pod) in devices::reserved_on(&dra.claims, &view.devices) {
                let listed = items
                    .iter()
                    .any(|p| p.name_any() == pod && p.namespace().as_deref() == Some(&namespace));
                if listed {
                    continue;
                }
                let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &namespace);
                if let Some(p) = api.get_opt(&pod).await.map_err(Error::read(&name))? {
                    items.push(p);
                }
            }
            for (pod, gpus) in devices::claimed_gpus(&dra.claims, &items, &view.devices) {
                let entry = held.entry(pod).or_default();
                for gpu in gpus {
                    if !entry.contains(&gpu) {
                        entry.push(gpu);
                    }
                }
            }
        }
        let gang_label = policy.spec.drain.gangs.label_key.as_deref();
        items
            .iter()
            .map(|p| pod_view(p, &held, gang_label))
            .collect()
    } else {
        Vec::new()
    };
    let disruption_budgets = if needs.disruption_budgets && !pods.is_empty() {
        let namespaces: BTreeSet<&str> = pods.iter().map(|p| p.namespace.as_str()).collect();
        let pdbs: Vec<PodDisruptionBudget> = ctx
            .budgets
            .state()
            .iter()
            .filter(|b| {
                b.namespace()
                    .is_some_and(|ns| namespaces.contains(ns.as_str()))
            })
            .map(|b| PodDisruptionBudget::clone(b))
            .collect();
        budget_views(&pdbs, &pods)
    } else {
        Vec::new()
    };
    let gangs = if needs.gangs {
        gangs::read(ctx, &policy.spec, &pods)
            .await
            .map_err(Error::read(&name))?
    } else {
        Vec::new()
    };
    let gang_windows = if needs.gang_windows {
        gangs::windows(&ctx.node_health.state(), &name)
    } else {
        Vec::new()
    };
    let workloads = if needs.workloads.is_empty() {
        Vec::new()
    } else {
        watched_workloads::watched(ctx, &needs.workloads)
            .await
            .map_err(Error::read(&name))?
    };
    let validation = match &needs.validation_pod {
        Some(pod) => {
            let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &ctx.validation.namespace);
            api.get_opt(pod)
                .await
                .map_err(Error::read(&name))?
                .map(|p| validation::view(&p))
        }
        None => None,
    };
    Ok(Some(Read {
        name,
        policy,
        policy_name,
        view,
        stored,
        in_cluster,
        recorded,
        needs,
        holders_now,
        pods,
        disruption_budgets,
        gangs,
        gang_windows,
        workloads,
        validation,
    }))
}

impl Read {
    /// After the step: what was seen of the GPUs' holders, so that the next
    /// step lists the pods only if they change (or their gates are due).
    pub fn remember_holders(&self, ctx: &Context) {
        let seen = if self.needs.gates_later {
            HoldersSeen::GatesPending
        } else {
            self.holders_now
        };
        ctx.memory.remember_holders(&self.name, seen);
    }
}

/// What the engine sees of `node` besides the object: the policy's
/// device-plugin resource, its DRA devices and gpuhealth's rules over them,
/// and the GPUs the kubelet calls unhealthy in the pods holding them.
fn beside(ctx: &Context, node: &Node, name: &str, quarantine: &Quarantine) -> Beside {
    let dra = ctx.dra.as_ref().map(|dra| DraView {
        can_taint: dra.rules.is_some(),
        devices: devices::devices_of(&dra.slices, name, &quarantine.dra_driver),
        rules: dra
            .rules
            .as_ref()
            .map(|r| fences::rules_of(&r.store, name))
            .unwrap_or_default(),
    });
    let unhealthy_devices = ctx.pod_health.on(
        name,
        quarantine,
        ctx.dra
            .as_ref()
            .zip(dra.as_ref())
            .map(|(watched, v)| (&watched.claims, v.devices.as_slice())),
    );
    Beside {
        gpu_resource: resource_count(node, &quarantine.device_plugin_resource),
        dra,
        unhealthy_devices,
    }
}
