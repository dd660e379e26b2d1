//! `gpuhealth.io/disruption-tolerance` on a pod: how a drain may treat it.

use std::{fmt, str::FromStr};

use super::{ContractError, DISRUPTION_TOLERANCE_ANNOTATION, checks::excerpt};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DisruptionTolerance {
    /// Evict through the Eviction API (PodDisruptionBudgets hold). The default.
    #[default]
    Evict,
    /// Let it finish on its own, up to the drain timeout (batch jobs).
    Wait,
    /// Never evict or delete it; the node waits for a person instead.
    Never,
}

impl DisruptionTolerance {
    /// The tolerance a pod's annotation asks for; absent means `Evict`.
    pub fn from_annotation(value: Option<&str>) -> Result<Self, ContractError> {
        value.map_or(Ok(DisruptionTolerance::Evict), str::parse)
    }
}

impl FromStr for DisruptionTolerance {
    type Err = ContractError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "evict" => Ok(DisruptionTolerance::Evict),
            "wait" => Ok(DisruptionTolerance::Wait),
            "never" => Ok(DisruptionTolerance::Never),
            other => Err(ContractError::Invalid {
                annotation: DISRUPTION_TOLERANCE_ANNOTATION,
                field: "value".into(),
                reason: format!("{:?} is not one of evict, wait, never", excerpt(other)),
            }),
        }
    }
}

impl fmt::Display for DisruptionTolerance {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DisruptionTolerance::Evict => "evict",
            DisruptionTolerance::Wait => "wait",
            DisruptionTolerance::Never => "never",
        })
    }
}
