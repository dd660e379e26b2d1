//! What every reconcile shares.

use gpuhealth_api::{GpuHealthPolicy, GpuNodeHealth};
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
