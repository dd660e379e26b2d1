//! A provider's maintenance notice: whether its time to drain has come.

use gpuhealth_api::vocabulary::FindingSubject;
use std::time::Duration;

use gpuhealth_api::{contract::MaintenanceNotice, vocabulary::FindingKind};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use crate::machine::{core::Stepper, maintenance_headline, whole_second};

impl Stepper<'_> {
    /// A maintenance notice to act on now: its lead time has come, or a GPU
    /// failed before it and the policy leaves the repair to the provider.
    pub(super) fn maintenance_due(&mut self) -> Option<MaintenanceNotice> {
        let policy = self.spec().maintenance.clone();
        if !policy.enabled {
            return None;
        }
        let mut notice = match &self.input.node.maintenance {
            Some(Ok(n)) => n.clone(),
            Some(Err(e)) => {
                let message = format!("the maintenance notice was ignored: {e}");
                self.finding(FindingKind::MalformedMaintenanceNotice, None, message);
                return None;
            }
            None => return None,
        };
        // Kubernetes stores times to the second: the deadline recorded in
        // status must compare equal to the notice's when read back.
        notice.deadline = Time(whole_second(notice.deadline.0));
        let handled = self
            .status
            .history
            .iter()
            .any(|i| i.maintenance_deadline.as_ref() == Some(&notice.deadline));
        if handled {
            return None;
        }
        let now = self.now();
        if now >= notice.deadline.0 {
            let message = format!(
                "{} passed before gpuhealth drained the node: if the provider has not acted yet it may at any moment; once the work is done, remove the gpuhealth.io/maintenance annotation",
                maintenance_headline(&notice)
            );
            self.finding(
                FindingKind::MaintenanceDeadlinePassed,
                Some(FindingSubject::Named(notice.source.clone())),
                message,
            );
            return None;
        }
        let drain_from = notice
            .deadline
            .0
            .checked_sub(
                k8s_openapi::jiff::SignedDuration::try_from(policy.lead_time.as_std()).ok()?,
            )
            .ok()?;
        let gpu_waits = self.diagnosis.required().is_some() && !policy.remediate_before;
        if now >= drain_from || gpu_waits {
            return Some(notice);
        }
        let left = drain_from
            .duration_since(now)
            .try_into()
            .unwrap_or(Duration::ZERO);
        self.wait(left);
        None
    }
}
