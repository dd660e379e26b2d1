//! What every reconcile shares.

use std::collections::HashMap;

use gpuhealth_api::{GpuHealthPolicy, GpuNodeHealth, node_health::GpuNodeHealthStatus};
use k8s_openapi::api::core::v1::Node;
use kube::{Client, runtime::events::Recorder, runtime::reflector::Store};

/// The field manager for everything gpuhealth writes.
pub const MANAGER: &str = "gpuhealth-operator";

pub struct Context {
    pub client: Client,
    pub nodes: Store<Node>,
    pub policies: Store<GpuHealthPolicy>,
    pub node_health: Store<GpuNodeHealth>,
    pub recorder: Recorder,
    /// Decisions that may start a remediation are made one at a time, each
    /// seeing the statuses the ones before it wrote: reconciles of different
    /// nodes run concurrently, and two nodes deciding at once on the same
    /// budget could both start.
    pub decisions: tokio::sync::Mutex<HashMap<String, GpuNodeHealthStatus>>,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("serialising: {0}")]
    Json(#[from] serde_json::Error),
    #[error("the engine made an invalid request id: {0}")]
    InvalidId(String),
}

impl Error {
    /// A short, stable label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube(_) => "kube",
            Error::Json(_) => "json",
            Error::InvalidId(_) => "invalid_id",
        }
    }
}
