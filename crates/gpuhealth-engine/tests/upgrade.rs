//! A node whose status release 0.1 wrote carries on under this release:
//! each saved status (`gpuhealth-api/tests/fixtures/status-0.1`) is read
//! and stepped until the node settles, and a request 0.1 had in flight is
//! re-issued under its own id, never a new one.

mod common;

use std::{fs, path::Path, time::Duration};

use common::World;
use gpuhealth_api::{
    GpuHealth,
    node_health::{GpuNodeHealthStatus, Phase},
    policy::Mode,
};
use gpuhealth_engine::machine::Action;

fn saved() -> Vec<(String, GpuNodeHealthStatus)> {
    let dir =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../gpuhealth-api/tests/fixtures/status-0.1");
    let mut all: Vec<(String, GpuNodeHealthStatus)> = fs::read_dir(&dir)
        .expect("the saved statuses")
        .map(|e| e.expect("an entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .map(|p| {
            let text = fs::read_to_string(&p).expect("readable");
            let status = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{p:?}: {e}"));
            (p.display().to_string(), status)
        })
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(all.len() >= 30, "{}", all.len());
    all
}

#[test]
fn every_saved_status_steps_on_until_the_node_settles() {
    for (path, status) in saved() {
        let mut w = World::incident();
        w.spec.mode = Mode::Enforce;
        w.state = status.clone();
        // The cordon 0.1 made for the incident in flight, if one is.
        w.node.unschedulable = status.incident.is_some();
        w.node.cordoned_by = status.incident.clone();
        let in_flight = status
            .action
            .as_ref()
            .filter(|a| status.phase == Phase::Remediating && a.requested_at.is_some())
            .map(|a| a.id.clone());
        w.set_gpu_health(7, GpuHealth::Healthy);
        w.run_until(
            |w| matches!(w.state.phase, Phase::Healthy | Phase::Failed),
            Duration::from_secs(6 * 3600),
        );
        if let Some(id) = in_flight {
            let asked: Vec<_> = w
                .log
                .iter()
                .filter_map(|a| match a {
                    Action::RequestReset { id, .. } | Action::RequestReboot { id, .. } => {
                        Some(id.clone())
                    }
                    _ => None,
                })
                .collect();
            assert_eq!(
                asked.first(),
                Some(&id),
                "{path}: 0.1's request {id} in flight, but this release asked {asked:?}"
            );
        }
        // What 0.1 recorded of its last incident is kept, and only added to.
        if let Some(old) = status.history.first() {
            assert!(
                w.state
                    .history
                    .iter()
                    .any(|i| i.id == old.id && i.attempts.starts_with(&old.attempts)),
                "{path}: incident {} lost or rewritten",
                old.id
            );
        }
    }
}
