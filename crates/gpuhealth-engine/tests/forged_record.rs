//! A record the operator did not write is carried out in nothing: a
//! GpuNodeHealth that says a reboot is in flight on a healthy node, written
//! by someone with RBAC on the records, yields no request, no drain and no
//! escalation, and a finding says so. A record a release before seals
//! wrote in flight carries on where the operator's own fence or request
//! names it.

mod common;

use std::time::Duration;

use common::World;
use gpuhealth_api::{
    RecoveryAction,
    contract::RequestId,
    node_health::{ActionStatus, GpuNodeHealthStatus, Phase},
    vocabulary::{FindingKind, Reason},
};
use gpuhealth_engine::machine::{Action, RecordSeal};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

/// A healthy node whose record someone wrote to say a reboot is in flight,
/// long past its deadline.
fn forged(seal: RecordSeal) -> World {
    let mut w = World::incident();
    w.clear();
    let incident = "inc-1780000000-forged".to_owned();
    let id = RequestId::for_attempt(&incident, RecoveryAction::NodeReboot, 1);
    let long_ago = Time(
        w.now
            .saturating_sub(Duration::from_secs(3600))
            .expect("time"),
    );
    w.state = GpuNodeHealthStatus {
        phase: Phase::Remediating,
        incident: Some(incident),
        action: Some(ActionStatus {
            id,
            type_: RecoveryAction::NodeReboot,
            attempt: 1,
            gpus: Vec::new(),
            started_at: long_ago.clone(),
            requested_at: Some(long_ago.clone()),
            deadline: Some(long_ago),
        }),
        ..Default::default()
    };
    w.seal = seal;
    w
}

fn asked(w: &World) -> usize {
    w.count(|a| {
        matches!(
            a,
            Action::RequestReboot { .. } | Action::RequestReset { .. } | Action::Cordon { .. }
        )
    })
}

#[test]
fn a_record_someone_else_wrote_is_carried_out_in_nothing() {
    for seal in [RecordSeal::Broken, RecordSeal::Absent] {
        let mut w = forged(seal);
        for _ in 0..5 {
            w.reconcile();
            w.advance(Duration::from_secs(30));
        }
        assert_eq!(asked(&w), 0, "{seal:?}: {:?}", w.log);
        assert!(w.executed.is_empty());
        assert_eq!(w.state.phase, Phase::Remediating, "held where it is");
        assert_eq!(w.state.reason, Some(Reason::Held));
        assert!(
            w.state.history.is_empty(),
            "no escalation recorded: {:?}",
            w.state.history
        );
        let found: Vec<_> = w
            .state
            .findings
            .iter()
            .filter(|f| f.type_ == FindingKind::ForgedRecord)
            .collect();
        assert_eq!(found.len(), 1, "{seal:?}: {:?}", w.state.findings);
        assert!(
            found[0].message.contains("did not write it"),
            "{}",
            found[0].message
        );
    }
}

#[test]
fn the_operators_own_record_carries_on() {
    // Sealed by the operator: the reboot timed out, and the ladder goes on
    // (past its last rung: the node fails, for a person).
    let mut w = forged(RecordSeal::Verified);
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Failed);
    assert!(
        w.state
            .findings
            .iter()
            .all(|f| f.type_ != FindingKind::ForgedRecord)
    );
    assert_ne!(w.state.reason, Some(Reason::Held));
}

#[test]
fn an_unsealed_record_an_earlier_release_wrote_carries_on_where_its_request_names_it() {
    let mut w = forged(RecordSeal::Absent);
    // The earlier release wrote the request beside its record (only the
    // operator may write a request).
    w.state.action.as_mut().expect("in flight").deadline = Some(Time(
        w.now
            .saturating_add(Duration::from_secs(600))
            .expect("time"),
    ));
    w.node.reboot_request = w.state.action.as_ref().map(|a| a.id.clone());
    w.node.unschedulable = true;
    w.node.cordoned_by = w.state.incident.clone();
    w.reconcile();
    assert!(
        w.state
            .findings
            .iter()
            .all(|f| f.type_ != FindingKind::ForgedRecord),
        "{:?}",
        w.state.findings
    );
    // The new boot proves the reboot, and the incident goes on to verify.
    w.node.boot_id = "boot-2".into();
    w.state.boot_id_before_reboot = Some("boot-1".into());
    w.reconcile();
    assert_eq!(w.state.phase, Phase::Verifying, "{:?}", w.state.message);
}
