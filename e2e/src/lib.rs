//! The e2e harness: a client for the local test cluster (started on first
//! use, or taken from `GPUHEALTH_E2E_KUBECONFIG`), unique names per test,
//! waits on conditions with deadlines, and simulated GPU nodes and pods.
//!
//! Everything here talks to a real kube-apiserver; nothing is mocked.

pub mod agent;
pub mod alerts;
pub mod audit;
pub mod chaos;
pub mod cluster;
pub mod crds;
pub mod dra;
pub mod host;
pub mod identities;
pub mod in_flight;
pub mod invariants;
pub mod kubelet;
pub mod names;
pub mod node_agent;
pub mod operator;
pub mod overlay;
pub mod plugin;
pub mod pod_resources;
pub mod process;
pub mod proxy;
pub mod real_node;
pub mod recorder;
pub mod reports;
pub mod scenario;
pub mod shipped;
pub mod sim;
pub mod system_bus;
pub mod wait;

pub use cluster::{client, helm, kubectl};
pub use names::unique;

/// Errors of the harness itself (tests turn them into failures with context).
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    #[error("starting the local cluster failed: {0}")]
    ClusterStart(String),
    #[error("kubeconfig {path}: {source}")]
    Kubeconfig {
        path: String,
        source: kube::config::KubeconfigError,
    },
    #[error("client: {0}")]
    Client(#[from] kube::Error),
    #[error("serialising: {0}")]
    Json(#[from] serde_json::Error),
    #[error("timed out after {secs}s waiting for {what}")]
    Timeout { what: String, secs: u64 },
    #[error("{0}")]
    Invalid(String),
    /// kubectl or helm failed, or could not be run.
    #[error("running {tool} {args}: {detail}")]
    Tool {
        tool: &'static str,
        args: String,
        detail: String,
    },
}

pub type Result<T, E = HarnessError> = std::result::Result<T, E>;
