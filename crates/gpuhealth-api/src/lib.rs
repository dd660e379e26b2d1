//! gpuhealth's API: the two custom resources (`GpuHealthPolicy`,
//! `GpuNodeHealth`) and the node annotation contract through which detectors,
//! the operator and the node agent talk. Types and validation only; no I/O.

pub mod contract;
pub mod crds;
pub mod device_taint_rule;
pub mod duration;
pub mod gang;
pub mod node_health;
pub mod policy;
pub mod quarantine;
pub mod reference;
mod string_form;
pub mod types;
pub mod vocabulary;

pub use duration::Duration;
pub use node_health::{GpuNodeHealth, GpuNodeHealthSpec, GpuNodeHealthStatus};
pub use policy::{GpuHealthPolicy, GpuHealthPolicySpec, GpuHealthPolicyStatus};
pub use types::{GpuHealth, RecoveryAction};

/// The API group of both custom resources.
pub const GROUP: &str = "gpuhealth.io";
/// The API version of both custom resources.
pub const VERSION: &str = "v1alpha1";
/// The category that makes `kubectl get gpuhealth` list both kinds.
pub const CATEGORY: &str = "gpuhealth";
