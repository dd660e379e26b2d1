//! The node annotation contract: what detectors write on a Node, what the
//! operator asks the node agent, and what the agent answers. Any producer may
//! write these annotations, so every value is parsed as untrusted input:
//! bounded in size, checked field by field, and refused with a typed error
//! that names the field, never a panic.

mod checks;
mod diagnostics;
mod gpu_report;
mod maintenance;
mod requests;
mod tolerance;

pub use diagnostics::{
    DiagnosticTest, DiagnosticsLevel, DiagnosticsRequest, DiagnosticsResult, DiagnosticsVerdict,
    MAX_TESTS as MAX_DIAGNOSTIC_TESTS, TestVerdict,
};
pub use gpu_report::{
    Capabilities, GpuEntry, GpuReport, PodRef, RebootMethod, RemappedRows, XidEvent,
};
pub use maintenance::MaintenanceNotice;
pub use requests::{CordonRecord, Outcome, RebootRequest, RequestId, RequestResult, ResetRequest};
pub use tolerance::DisruptionTolerance;

use serde::{Serialize, de::DeserializeOwned};

/// Node annotation: the versioned per-GPU report ([`GpuReport`]).
pub const GPU_REPORT_ANNOTATION: &str = "gpuhealth.io/gpus";
/// Node annotation: the operator asks the agent to reset GPUs ([`ResetRequest`]).
pub const RESET_REQUEST_ANNOTATION: &str = "gpuhealth.io/reset-request";
/// Node annotation: the operator asks the agent to reboot the node ([`RebootRequest`]).
pub const REBOOT_REQUEST_ANNOTATION: &str = "gpuhealth.io/reboot-request";
/// Node annotation: the operator asks the agent to run DCGM's diagnostic on
/// repaired GPUs ([`DiagnosticsRequest`]).
pub const DIAGNOSTICS_REQUEST_ANNOTATION: &str = "gpuhealth.io/diagnostics-request";
/// Node annotation: the agent's answer to the latest request ([`RequestResult`]).
pub const REQUEST_RESULT_ANNOTATION: &str = "gpuhealth.io/request-result";
/// Node annotation: a scheduled maintenance notice ([`MaintenanceNotice`]).
pub const MAINTENANCE_ANNOTATION: &str = "gpuhealth.io/maintenance";
/// Node annotation: set in the same write as a cordon by gpuhealth, so that
/// only a node gpuhealth cordoned is ever uncordoned by it ([`CordonRecord`]).
pub const CORDONED_BY_ANNOTATION: &str = "gpuhealth.io/cordoned-by";
/// Break glass: set (to the reason) by an administrator who removed a
/// request or the cordon record by hand; the operator says so and clears it.
pub const BREAK_GLASS_ANNOTATION: &str = "gpuhealth.io/break-glass";
/// Pod annotation: how a pod may be disrupted ([`DisruptionTolerance`]).
pub const DISRUPTION_TOLERANCE_ANNOTATION: &str = "gpuhealth.io/disruption-tolerance";
/// Node label: set when a node is handed off for replacement.
pub const REPLACE_LABEL: &str = "gpuhealth.io/replace";
/// Node label, `true` when a node's GPUs failed more often than the
/// policy's `remediationLimits` allow: for an RMA process or Cluster API.
pub const NEEDS_REPLACEMENT_LABEL: &str = "gpuhealth.io/needs-replacement";
/// Node condition type written by detectors (`True` means healthy).
pub const GPU_HEALTHY_CONDITION: &str = "GpuHealthy";
/// Pod readiness gate and condition: a pod that lists it in
/// `spec.readinessGates` is Ready only while the GPUs it holds are healthy.
pub const GPU_HEALTHY_READINESS_GATE: &str = "gpuhealth.io/gpu-healthy";

/// The largest annotation value the contract accepts. The API server caps all
/// annotations of an object at 256 KiB together; one value of ours has no
/// business being larger than this.
pub const MAX_VALUE_BYTES: usize = 64 * 1024;

/// Why an annotation value was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ContractError {
    #[error("{annotation}: value is {size} bytes, over the limit of {limit}")]
    TooLarge {
        annotation: &'static str,
        size: usize,
        limit: usize,
    },
    #[error("{annotation}: not valid JSON for this annotation: {detail}")]
    Malformed {
        annotation: &'static str,
        detail: String,
    },
    #[error(
        "{annotation}: version {found} is not supported (this build reads version {supported})"
    )]
    UnsupportedVersion {
        annotation: &'static str,
        found: u32,
        supported: u32,
    },
    #[error("{annotation}: field {field}: {reason}")]
    Invalid {
        annotation: &'static str,
        field: String,
        reason: String,
    },
}

impl ContractError {
    /// A short, stable label for metrics (`malformed`, `invalid`, ...).
    pub fn metric_label(&self) -> &'static str {
        match self {
            ContractError::TooLarge { .. } => "too_large",
            ContractError::Malformed { .. } => "malformed",
            ContractError::UnsupportedVersion { .. } => "unsupported_version",
            ContractError::Invalid { .. } => "invalid",
        }
    }
}

/// A value carried in a node or pod annotation.
pub trait AnnotationValue: Serialize + DeserializeOwned {
    /// The annotation key this value lives under.
    const ANNOTATION: &'static str;

    /// Checks what the JSON shape alone cannot: bounds, formats, uniqueness.
    fn check(&self) -> Result<(), ContractError>;

    /// Parses and checks an annotation value.
    fn parse(raw: &str) -> Result<Self, ContractError> {
        if raw.len() > MAX_VALUE_BYTES {
            return Err(ContractError::TooLarge {
                annotation: Self::ANNOTATION,
                size: raw.len(),
                limit: MAX_VALUE_BYTES,
            });
        }
        let value: Self = serde_json::from_str(raw).map_err(|e| ContractError::Malformed {
            annotation: Self::ANNOTATION,
            detail: e.to_string(),
        })?;
        value.check()?;
        Ok(value)
    }

    /// The annotation value, as compact JSON.
    fn to_annotation(&self) -> String {
        // Serialising these plain structs cannot fail: no maps with non-string
        // keys, no custom serialisers that error.
        serde_json::to_string(self).unwrap_or_default()
    }
}
