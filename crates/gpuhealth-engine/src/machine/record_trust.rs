//! Whether the stored record is the operator's own. The operator carries on
//! whatever its record says is under way (an attempt in flight, a fence,
//! a reboot awaited), so a record someone else wrote would be laundered
//! into real requests. Admission lets only the operator write records;
//! behind that, the operator seals each record it writes with something
//! only it can make (`status.seal`, a keyed hash of what is under way),
//! and carries out nothing of a record in flight whose seal is not its own.

use gpuhealth_api::{
    contract::RequestId,
    node_health::{GpuNodeHealthStatus, Phase},
    vocabulary::{FindingKind, Reason},
};

use crate::machine::{Input, core::Stepper};

/// What the operator found of the stored record's seal.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RecordSeal {
    /// The seal is the operator's own, for what the record says.
    #[default]
    Verified,
    /// There is none: a release before seals wrote the record, or someone
    /// took the seal off.
    Absent,
    /// There is one, and it is not the operator's for what the record says.
    Broken,
}

/// Whether `status` says something is under way that a step would carry
/// on: only such a record needs the operator's seal.
pub fn in_flight(status: &GpuNodeHealthStatus) -> bool {
    !matches!(status.phase, Phase::Healthy | Phase::Suspect)
        || status.incident.is_some()
        || status.action.is_some()
        || status.quarantine.is_some()
}

/// Why `input`'s stored record is not the operator's, if it is not: a
/// record in flight whose seal is broken, or which has none and nothing
/// only the operator writes (its cordon record, a request, a device fence,
/// each refused to anyone else by admission) names what it records, as
/// something does for a record a release before seals wrote. The operator
/// seals a decision only where this says the record was its own.
pub fn record_not_ours(input: &Input<'_>) -> Option<&'static str> {
    if !in_flight(input.state) {
        return None;
    }
    match input.seal {
        RecordSeal::Verified => None,
        RecordSeal::Absent if fenced_or_asked_for_it(input) => None,
        RecordSeal::Absent => Some(
            "it carries no seal of the operator's, and nothing on the node that only the operator writes (its cordon record, a request, a device fence) names its incident or its attempt",
        ),
        RecordSeal::Broken => Some("its seal is not the operator's for what it says"),
    }
}

fn fenced_or_asked_for_it(input: &Input<'_>) -> bool {
    let (node, state) = (input.node, input.state);
    let incident = state.incident.as_deref();
    let cordoned = incident.is_some() && node.cordoned_by.as_deref() == incident;
    let fenced = node.dra.as_ref().is_some_and(|dra| {
        dra.rules
            .iter()
            .any(|r| Some(r.incident.as_str()) == incident)
    });
    let asked = state.action.as_ref().is_some_and(|a| {
        let diagnostics = RequestId::for_diagnostics(&a.id);
        [&node.reset_request, &node.reboot_request]
            .iter()
            .any(|r| r.as_ref() == Some(&a.id))
            || node.diagnostics_request.as_ref() == Some(&diagnostics)
    });
    cordoned || fenced || asked
}

impl Stepper<'_> {
    /// Holds a record that is not the operator's where it is: nothing it
    /// records is carried out (no request, no drain, no escalation on its
    /// timeout), and a finding says so (an Event, the alert
    /// `GpuHealthForgedRecord`).
    pub(super) fn hold_record_not_ours(&mut self, why: &str) {
        // Observing may have asked for a write of the node's condition:
        // nothing at all is done from this record.
        self.actions.clear();
        let state = self.input.state;
        let action = state.action.as_ref().map_or_else(String::new, |a| {
            format!(", {:?} attempt {} ({}) in flight", a.type_, a.attempt, a.id)
        });
        self.finding(
            FindingKind::ForgedRecord,
            None,
            format!(
                "this node's GpuNodeHealth says {:?}{action}, but gpuhealth's operator did not write it: {why}; nothing it records is carried out. Find who wrote it (the API server's audit log), then delete the record (break glass) so that the operator starts afresh",
                state.phase
            ),
        );
        self.status.reason = Some(Reason::Held);
        self.status.message = Some(format!(
            "held in {:?}: the record was not written by gpuhealth's operator ({why})",
            state.phase
        ));
        self.requeue = None;
    }
}
