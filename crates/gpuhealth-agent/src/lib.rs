//! The gpuhealth node agent's parts, each testable without a GPU or a
//! cluster. The binary (`main.rs`) puts them together.

pub mod kmsg;
pub mod nvml;
