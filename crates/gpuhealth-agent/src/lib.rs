//! The gpuhealth node agent's parts, each testable without a GPU or a
//! cluster. The binary (`main.rs`) puts them together.

pub mod authority;
pub mod backend;
pub mod fake;
pub mod holders;
pub mod journal;
pub mod judgement;
pub mod kmsg;
pub mod metrics;
pub mod node_agent;
pub mod nvml;
pub mod nvml_backend;
pub mod nvml_thread;
pub mod operands;
pub mod pod_resources;
pub mod reboot;
pub mod recoveries;
pub mod reset;
