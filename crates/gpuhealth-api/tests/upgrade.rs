//! Statuses written by release 0.1 (saved in `fixtures/status-0.1`) are
//! read by this release with nothing lost: the same reasons, findings and
//! outcomes, every attempt read from its words, every other field as it was.

use std::fs;

use gpuhealth_api::node_health::GpuNodeHealthStatus;
use serde_json::Value;

fn fixtures() -> Vec<(String, Value)> {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/status-0.1");
    let mut all: Vec<(String, Value)> = fs::read_dir(dir)
        .expect("the fixtures")
        .map(|e| e.expect("a fixture").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .map(|p| {
            let text = fs::read_to_string(&p).expect("readable");
            (
                p.display().to_string(),
                serde_json::from_str(&text).expect("JSON"),
            )
        })
        .collect();
    all.sort_by(|a, b| a.0.cmp(&b.0));
    assert!(all.len() >= 30, "fixtures missing: {}", all.len());
    all
}

/// The status as written now, with each incident's `attempts` taken out,
/// and the status as 0.1 wrote it, with its `actions` taken out: equal.
fn without(mut v: Value, field: &str) -> Value {
    if let Some(history) = v.get_mut("history").and_then(Value::as_array_mut) {
        for incident in history {
            if let Some(o) = incident.as_object_mut() {
                o.remove(field);
            }
        }
    }
    v
}

#[test]
fn every_saved_status_reads_with_nothing_lost() {
    let mut attempts_read = 0;
    for (path, old) in fixtures() {
        let status: GpuNodeHealthStatus =
            serde_json::from_value(old.clone()).unwrap_or_else(|e| panic!("{path}: {e}"));
        let now = serde_json::to_value(&status).expect("serialises");
        assert_eq!(
            without(now.clone(), "attempts"),
            without(old.clone(), "actions"),
            "{path}: a field other than the attempts changed"
        );
        let old_history = old["history"].as_array().cloned().unwrap_or_default();
        for (incident, before) in status.history.iter().zip(&old_history) {
            let words = before["actions"].as_array().cloned().unwrap_or_default();
            assert!(
                incident.actions.is_empty(),
                "{path}: entries not read as attempts: {:?}",
                incident.actions
            );
            assert_eq!(incident.attempts.len(), words.len(), "{path}");
            attempts_read += words.len();
        }
        // Written now, read again: the same.
        let again: GpuNodeHealthStatus = serde_json::from_value(now).expect("reads back");
        assert_eq!(again, status, "{path}: not stable once rewritten");
    }
    assert!(
        attempts_read > 20,
        "too few attempts in the fixtures: {attempts_read}"
    );
}

#[test]
fn words_this_release_cannot_read_are_kept() {
    let old = serde_json::json!({
        "phase": "Failed",
        "history": [{
            "id": "inc-1",
            "startedAt": "2026-01-01T00:00:00Z",
            "trigger": "t",
            "actions": ["GpuReset#1 Failed", "something a later release wrote"],
            "outcome": "Failed",
        }],
    });
    let status: GpuNodeHealthStatus = serde_json::from_value(old).expect("reads");
    let incident = &status.history[0];
    assert_eq!(incident.attempts.len(), 1);
    assert_eq!(incident.actions, ["something a later release wrote"]);
    let written = serde_json::to_value(&status).expect("serialises");
    assert_eq!(
        written["history"][0]["actions"],
        serde_json::json!(["something a later release wrote"])
    );
}
