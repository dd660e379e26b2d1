//! What every reconcile shares.

use std::{collections::HashMap, sync::Arc};

use gpuhealth_api::{GpuHealthPolicy, GpuNodeHealth, node_health::GpuNodeHealthStatus};
use k8s_openapi::api::{core::v1::Node, policy::v1::PodDisruptionBudget};
use kube::{
    Client,
    runtime::reflector::{Store, store::WriterDropped},
};
use parking_lot::{Mutex, MutexGuard};

pub use crate::error::Error;
use crate::{leader::Leadership, metrics::Metrics};

/// The field manager for everything gpuhealth writes.
pub const MANAGER: &str = "gpuhealth-operator";

pub struct Context {
    pub client: Client,
    /// Node reconciles running now: a pass over every node is paced by it
    /// (`pass`).
    pub in_flight: Arc<crate::pass::InFlight>,
    pub nodes: Store<Node>,
    pub policies: Store<GpuHealthPolicy>,
    pub node_health: Store<GpuNodeHealth>,
    /// The per-GPU tables `node_health` leaves out, as hashes.
    pub gpu_tables: crate::slim::GpuTables,
    /// Every PodDisruptionBudget, from one watch: what a drain and a DryRun
    /// plan say of them, read with no request of their own.
    pub budgets: Store<PodDisruptionBudget>,
    /// The cluster's DRA devices' taints and gpuhealth's
    /// `DeviceTaintRule`s, from watches; None where it serves no DRA.
    pub dra: Option<crate::devices::Dra>,
    /// The pods holding a device the kubelet calls unhealthy, from a
    /// watch of every pod.
    pub pod_health: Arc<crate::pod_health::PodHealth>,
    pub events: crate::events::Events,
    /// What this process remembers of each node between its reconciles
    /// (its latest decision, GPU holders and report), forgotten with it.
    pub memory: crate::memory::NodeMemory,
    /// What the API server showed once this replica's term began, for the
    /// starts of its first minute.
    pub at_takeover: crate::takeover::AtTakeover,
    pub metrics: Arc<Metrics>,
    /// Whether the install's admission protection is in force
    /// (`protection`): nothing is enforced while it is not.
    pub protection: Arc<crate::protection::Protection>,
    /// The cluster administrator's bounds on every policy (the flags).
    pub guardrails: gpuhealth_engine::guardrails::Guardrails,
    /// Failed reconciles in a row, per object, for the back-off.
    pub failures: crate::error::Failures,
    /// Per policy, what this process last announced of what cannot be
    /// honoured (its `Ready` message, or `None` when all could be): each
    /// change is announced once, even when a reconcile reads a policy whose
    /// status the last one's write has not reached yet.
    pub honour_announced: Mutex<HashMap<String, Option<String>>>,
    /// Other tools' locks that name nodes (kured, Medik8s), kept fresh by
    /// `locks::poll`.
    pub locks: Arc<crate::locks::Locks>,
    /// Checked before every write: a replica that is not the leader (or no
    /// longer sure it is) writes nothing.
    pub leadership: Leadership,
    /// Where the crash-safety tests make the process exit (`failpoint`).
    pub crash_after: crate::failpoint::CrashAfter,
    /// Where validation pods run, and as whom.
    pub validation: crate::validation::Target,
    /// What the operator seals its records with, and checks them by.
    pub seal: crate::seal::Seal,
}

impl Context {
    /// Resolves once every store a step reads has its first list, and the
    /// other tools' locks their first read. The node
    /// loop's own store, and the policies' and statuses' (filled before
    /// leadership is sought), are waited for elsewhere.
    pub async fn caches_ready(&self) -> Result<(), WriterDropped> {
        self.locks.read_once().await;
        self.budgets.wait_until_ready().await?;
        if let Some(dra) = &self.dra {
            dra.ready().await?;
        }
        Ok(())
    }

    /// This process's latest decision for each node it decided on.
    pub fn lock_decisions(&self) -> MutexGuard<'_, HashMap<String, GpuNodeHealthStatus>> {
        self.memory.lock_decisions()
    }
}

/// The latest status of every node, once each and borrowed (it runs on
/// every reconcile): what this process wrote last (`written`), else what
/// the watch shows (`store`, from `ctx.node_health.state()`).
pub fn latest<'a>(
    store: &'a [Arc<GpuNodeHealth>],
    written: &'a HashMap<String, GpuNodeHealthStatus>,
) -> impl Iterator<Item = (&'a str, &'a GpuNodeHealthStatus)> {
    let watched = store.iter().filter_map(|g| {
        let name = g.metadata.name.as_deref()?;
        (!written.contains_key(name)).then_some((name, g.status.as_ref()?))
    });
    watched.chain(written.iter().map(|(k, v)| (k.as_str(), v)))
}
