//! The operator's requests to the node agent and the agent's answer. Every
//! request carries an id, so the operator recognises its own request after a
//! restart and the agent never carries out the same request twice.

use std::{fmt, str::FromStr};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::RecoveryAction;
use serde::{Deserialize, Serialize};

use crate::string_form::string_form;

use super::{
    AnnotationValue, CORDONED_BY_ANNOTATION, ContractError, DiagnosticsResult,
    REBOOT_REQUEST_ANNOTATION, REQUEST_RESULT_ANNOTATION, RESET_REQUEST_ANNOTATION,
    checks::{bounded_text, excerpt, gpu_uuids, invalid},
};

/// A request or incident id: 1 to 63 characters of `[a-z0-9-]`, starting
/// with a letter or digit.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(String);

impl RequestId {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// An incident's id: `inc-<unix seconds>-<node>`, the node as twelve hex
    /// digits of a hash of its name, so that nodes failing in the same second
    /// get different ids (a fleet-wide executor keys on them) and the id
    /// stays short whatever the node is called.
    pub fn for_incident(node: &str, unix_seconds: i64) -> RequestId {
        RequestId::made_of(&format!("inc-{unix_seconds}-{:012x}", node_hash(node)))
    }

    /// The id of an incident's attempt at a rung: `<incident>-reset-2`.
    pub fn for_attempt(incident: &str, action: RecoveryAction, attempt: u32) -> RequestId {
        let rung = match action {
            RecoveryAction::GpuReset => "reset",
            RecoveryAction::NodeReboot => "reboot",
            RecoveryAction::ReplaceNode => "replace",
        };
        RequestId::made_of(&format!("{incident}-{rung}-{attempt}"))
    }

    /// The id of the diagnostic run after attempt `action` succeeded.
    pub fn for_diagnostics(action: &RequestId) -> RequestId {
        RequestId::made_of(&format!("{action}-diagnostics"))
    }

    /// The id of a provider's maintenance handled by an incident.
    pub fn for_maintenance(incident: &str) -> RequestId {
        RequestId::made_of(&format!("{incident}-maintenance"))
    }

    /// An id from parts that may not all be valid: anything outside
    /// `[a-z0-9-]` becomes `-`, and the end is cut at 63 characters.
    fn made_of(raw: &str) -> RequestId {
        let mut id: String = raw
            .trim_start_matches('-')
            .chars()
            .map(|c| match c.to_ascii_lowercase() {
                c @ ('a'..='z' | '0'..='9' | '-') => c,
                _ => '-',
            })
            .take(63)
            .collect();
        if id.is_empty() {
            id.push('0');
        }
        RequestId(id)
    }
}

impl FromStr for RequestId {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let ok = !s.is_empty()
            && s.len() <= 63
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
            && !s.starts_with('-');
        if ok {
            Ok(RequestId(s.to_owned()))
        } else {
            Err(format!(
                "{:?} is not an id (1-63 of a-z, 0-9, -)",
                excerpt(s)
            ))
        }
    }
}

/// 48 bits of FNV-1a over a node's name: the same on every build and
/// release, so an id can be worked out again from the node and the second.
fn node_hash(node: &str) -> u64 {
    let hash = node.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    hash >> 16
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

string_form!(RequestId, "RequestId", {
    "type": "string",
    "pattern": "^[a-z0-9][a-z0-9-]{0,62}$",
});

/// `gpuhealth.io/reset-request`: reset these GPUs (by UUID, never by index).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ResetRequest {
    pub id: RequestId,
    pub gpus: Vec<String>,
    pub requested_at: Time,
}

impl AnnotationValue for ResetRequest {
    const ANNOTATION: &'static str = RESET_REQUEST_ANNOTATION;

    fn check(&self) -> Result<(), ContractError> {
        gpu_uuids(Self::ANNOTATION, &self.gpus)?;
        Ok(())
    }
}

/// `gpuhealth.io/reboot-request`: reboot the node. Proven done by the node's
/// `bootID` changing, not by the agent's word.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RebootRequest {
    pub id: RequestId,
    pub requested_at: Time,
}

impl AnnotationValue for RebootRequest {
    const ANNOTATION: &'static str = REBOOT_REQUEST_ANNOTATION;

    fn check(&self) -> Result<(), ContractError> {
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    Succeeded,
    Failed,
    /// Not attempted: a precondition did not hold (a process still on the GPU).
    Refused,
}

/// `gpuhealth.io/request-result`: the agent's answer to request `id`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RequestResult {
    pub id: RequestId,
    pub outcome: Outcome,
    #[serde(default)]
    pub message: String,
    pub finished_at: Time,
    /// What a diagnostic found: only in the answer to a
    /// [`super::DiagnosticsRequest`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diagnostics: Option<DiagnosticsResult>,
}

impl AnnotationValue for RequestResult {
    const ANNOTATION: &'static str = REQUEST_RESULT_ANNOTATION;

    fn check(&self) -> Result<(), ContractError> {
        bounded_text(&self.message, 1024).map_err(|r| invalid(Self::ANNOTATION, "message", r))?;
        match &self.diagnostics {
            Some(d) => d.check(Self::ANNOTATION),
            None => Ok(()),
        }
    }
}

/// `gpuhealth.io/cordoned-by`: written in the same patch as
/// `spec.unschedulable = true`, so ownership of the cordon is never in doubt.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CordonRecord {
    /// The incident that cordoned the node.
    pub incident: RequestId,
    pub at: Time,
}

impl AnnotationValue for CordonRecord {
    const ANNOTATION: &'static str = CORDONED_BY_ANNOTATION;

    fn check(&self) -> Result<(), ContractError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn incident_ids_differ_between_nodes_failing_in_the_same_second() {
        let a = RequestId::for_incident("gpu-node-1", 1_780_042_543);
        let b = RequestId::for_incident("gpu-node-2", 1_780_042_543);
        assert_ne!(a, b);
        assert_eq!(a, RequestId::for_incident("gpu-node-1", 1_780_042_543));
        assert!(a.as_str().starts_with("inc-1780042543-"), "{a}");
        assert_eq!(a.as_str().len(), "inc-1780042543-".len() + 12);
        // The same in every release: docs/annotations.md names this one.
        assert_eq!(
            RequestId::for_incident("gpu-node-7", 1_780_042_543).as_str(),
            "inc-1780042543-9a371f29eed4"
        );
        // A valid id, with room for the longest attempt id after it.
        let long = RequestId::for_attempt(
            &RequestId::for_incident(&"n".repeat(253), i64::MAX).to_string(),
            RecoveryAction::NodeReboot,
            u32::MAX,
        );
        assert!(
            long.as_str().ends_with(&format!("-reboot-{}", u32::MAX)),
            "{long}"
        );
        assert_eq!(long.as_str().parse::<RequestId>(), Ok(long.clone()));
    }
}
