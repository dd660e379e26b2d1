//! The gpuhealth node agent's parts, each testable without a GPU or a
//! cluster. The binary (`main.rs`) puts them together.

pub mod backend;
pub mod journal;
pub mod kmsg;
pub mod metrics;
pub mod node_agent;
pub mod nvml;
pub mod pod_resources;
