//! `gpuhealth.io/maintenance`: a scheduled maintenance notice, as a cloud
//! event bridge or a person writes it (the incident began with one: "the
//! vendor will stop the instance at 2026-06-02 08:15:52 unless authorised
//! sooner").

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde::{Deserialize, Serialize};

use super::{
    AnnotationValue, ContractError, MAINTENANCE_ANNOTATION,
    checks::{bounded_text, invalid, non_empty_text},
};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MaintenanceNotice {
    /// When the provider acts if nobody acts first.
    pub deadline: Time,
    /// Who announced it (`cloud-provider`, `ops`, ...).
    pub source: String,
    pub reason: String,
    /// The provider's ticket or event id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference: Option<String>,
}

impl AnnotationValue for MaintenanceNotice {
    const ANNOTATION: &'static str = MAINTENANCE_ANNOTATION;

    fn check(&self) -> Result<(), ContractError> {
        non_empty_text(&self.source, 128).map_err(|r| invalid(Self::ANNOTATION, "source", r))?;
        non_empty_text(&self.reason, 1024).map_err(|r| invalid(Self::ANNOTATION, "reason", r))?;
        if let Some(reference) = &self.reference {
            bounded_text(reference, 256).map_err(|r| invalid(Self::ANNOTATION, "reference", r))?;
        }
        Ok(())
    }
}
