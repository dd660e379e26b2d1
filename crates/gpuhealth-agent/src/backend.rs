//! Where GPU health comes from and how requests are carried out: NVML on a
//! real node ([`crate::nvml_backend`]), the `gpuhealth.io/sim-hardware`
//! annotation on a simulated one ([`crate::fake`]). The reporter calls
//! `source`, `capabilities`, `read` and `stand_aside`; the executor `tidy`,
//! `reset`, `reboot` and `gpu_indices` (see [`crate::node_agent::Role`]).

use std::future::Future;

use gpuhealth_api::contract::{Capabilities, GpuEntry};
use k8s_openapi::api::core::v1::Node;

use crate::{capability_checks::CapabilityChecks, done::Done};

pub trait Backend: Send {
    /// The report's `source`.
    fn source(&self) -> &'static str;
    /// What this backend can carry out on `node`, for the report.
    fn capabilities(&self, node: &Node) -> Capabilities;
    /// Every GPU now; `node` is the agent's Node as last seen. An error says
    /// why the GPUs cannot be read.
    fn read(&mut self, node: &Node) -> impl Future<Output = Result<Vec<GpuEntry>, String>> + Send;
    /// Resets `gpus` (UUIDs) for request `id`.
    fn reset(
        &mut self,
        node: &Node,
        id: &str,
        gpus: &[String],
    ) -> impl Future<Output = Done> + Send;
    fn reboot(&mut self, node: &Node, id: &str) -> impl Future<Output = Done> + Send;
    /// The index of each of `uuids`, in their order, as NVML and DCGM
    /// number the GPUs now (indices are not stable across boots, so they
    /// are looked up when needed); an error names a UUID not on the node.
    fn gpu_indices(
        &mut self,
        node: &Node,
        uuids: &[String],
    ) -> impl Future<Output = Result<Vec<u32>, String>> + Send {
        async move {
            let gpus = self.read(node).await?;
            let known: Vec<(&str, u32)> = gpus.iter().map(|g| (g.uuid.as_str(), g.index)).collect();
            indices_of(&known, uuids)
        }
    }
    /// The executor's work each pass: what an earlier run left unfinished
    /// (operands still paused), and what it can carry out, offered.
    fn tidy(&mut self, _node: &Node) -> impl Future<Output = ()> + Send {
        async {}
    }
    /// The executor's capability checks as last made, where it makes any.
    fn capability_checks(&self) -> Option<&CapabilityChecks> {
        None
    }
    /// The reporter's, each pass: whether a reset of the executor's needs
    /// the GPUs let go now (nothing is read or published meanwhile).
    fn stand_aside(&mut self) -> impl Future<Output = bool> + Send {
        async { false }
    }
}

/// The index of each of `uuids` among the `known` GPUs (UUID, index).
pub fn indices_of(known: &[(&str, u32)], uuids: &[String]) -> Result<Vec<u32>, String> {
    uuids
        .iter()
        .map(|uuid| {
            known
                .iter()
                .find(|(u, _)| u == uuid)
                .map(|(_, index)| *index)
                .ok_or_else(|| format!("no GPU {uuid} on this node"))
        })
        .collect()
}
