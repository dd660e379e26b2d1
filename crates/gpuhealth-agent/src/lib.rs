//! The gpuhealth node agent's parts, each testable without a GPU or a
//! cluster. The binary (`main.rs`) puts them together.

pub mod authority;
pub mod backend;
pub mod capability_checks;
pub mod dcgm;
pub mod diagnostics;
pub mod done;
pub mod driver_root;
pub mod fake;
pub mod handoff;
pub mod holders;
pub mod journal;
pub mod judgement;
pub mod kmsg;
pub mod metrics;
pub mod node_agent;
pub mod nvidia_smi;
pub mod nvml;
pub mod nvml_backend;
pub mod nvml_thread;
pub mod operands;
pub mod pod_resources;
pub mod reboot;
pub mod recoveries;
pub mod reset;
pub mod state_file;
pub mod withheld;

use kube::api::{PatchParams, PostParams};

/// The field manager of every write the agent makes, so that `managedFields`
/// and the audit log tell its writes from the operator's and anyone else's.
pub const MANAGER: &str = "gpuhealth-agent";

pub fn patch_params() -> PatchParams {
    PatchParams {
        field_manager: Some(MANAGER.to_owned()),
        ..PatchParams::default()
    }
}

pub fn post_params() -> PostParams {
    PostParams {
        field_manager: Some(MANAGER.to_owned()),
        ..PostParams::default()
    }
}
