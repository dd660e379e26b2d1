//! The status's words are written and matched through their types: no
//! source file outside `src/vocabulary/` spells a reason, finding kind,
//! outcome or attempt as a string literal, except where the same word
//! means something else (listed below, each with why).

use std::{fs, path::Path};

use gpuhealth_api::vocabulary::{
    AttemptAction, AttemptOutcome, FindingKind, IncidentOutcome, QuarantineWhy, Reason,
    WorkloadOutcome,
};

/// (file, word, why the word there is not the status's).
const ELSEWHERE: &[(&str, &str, &str)] = &[
    (
        "e2e/tests/records.rs",
        "*",
        "a record and a policy written as JSON, as someone other than the operator writes them",
    ),
    (
        "e2e/tests/contract.rs",
        "GpuReset",
        "the executor written from docs/annotations.md reads the record as JSON, as a third party would",
    ),
    (
        "crates/gpuhealth-operator/src/conditions.rs",
        "CircuitOpen",
        "a policy condition type",
    ),
    (
        "crates/gpuhealth-operator/src/policy_status.rs",
        "CircuitOpen",
        "a policy condition type and its Event",
    ),
    (
        "crates/kubectl-gpuhealth/src/status.rs",
        "CircuitOpen",
        "a policy condition type",
    ),
    (
        "e2e/src/chaos/storm.rs",
        "CircuitOpen",
        "a policy condition type",
    ),
    (
        "e2e/tests/remediation.rs",
        "CircuitOpen",
        "a policy condition type and its Event",
    ),
    (
        "e2e/tests/gitops.rs",
        "CircuitOpen",
        "a policy condition type",
    ),
    ("e2e/tests/gitops.rs", "Paused", "Argo CD's health word"),
    (
        "crates/gpuhealth-operator/src/pod_health.rs",
        "Unhealthy",
        "the kubelet's word for a device's health in pod status",
    ),
    (
        "e2e/tests/quarantine.rs",
        "Unhealthy",
        "the kubelet's word for a device's health in pod status",
    ),
    (
        "crates/gpuhealth-operator/src/observe.rs",
        "Succeeded",
        "a pod phase",
    ),
    (
        "crates/gpuhealth-operator/src/observe.rs",
        "Failed",
        "a pod phase",
    ),
    (
        "crates/gpuhealth-engine/src/machine/phases/verify.rs",
        "Succeeded",
        "the validation pod's phase",
    ),
    (
        "crates/gpuhealth-engine/src/machine/phases/verify.rs",
        "Failed",
        "the validation pod's phase",
    ),
    (
        "crates/gpuhealth-engine/src/workload.rs",
        "Succeeded",
        "a pod phase",
    ),
    (
        "crates/gpuhealth-engine/tests/scenarios.rs",
        "Succeeded",
        "the validation pod's phase",
    ),
    (
        "crates/gpuhealth-engine/tests/scenarios.rs",
        "Failed",
        "the validation pod's phase",
    ),
    (
        "crates/gpuhealth-engine/tests/diagnostics.rs",
        "Succeeded",
        "the validation pod's phase",
    ),
    (
        "crates/gpuhealth-engine/src/restarts.rs",
        "Unhealthy",
        "the kubelet's probe Event",
    ),
    (
        "crates/gpuhealth-engine/tests/workloads.rs",
        "Unhealthy",
        "the kubelet's probe Event",
    ),
    (
        "crates/kubectl-gpuhealth/src/probe_check/tests.rs",
        "Unhealthy",
        "the kubelet's probe Event",
    ),
    (
        "e2e/src/kubelet.rs",
        "Unhealthy",
        "the kubelet's probe Event",
    ),
    (
        "crates/gpuhealth-agent/src/node_agent.rs",
        "GpusUnreadable",
        "the GpuHealthy node condition's reason",
    ),
    (
        "e2e/tests/nvml_node.rs",
        "GpusUnreadable",
        "the GpuHealthy node condition's reason",
    ),
    (
        "crates/kubectl-gpuhealth/src/output.rs",
        "Draining",
        "a phase, painted",
    ),
    (
        "crates/kubectl-gpuhealth/src/output.rs",
        "Failed",
        "a phase, painted",
    ),
    (
        "crates/kubectl-gpuhealth/src/status.rs",
        "GpuReset",
        "the action in flight as the plugin shows it",
    ),
    (
        "crates/gpuhealth-agent/src/kmsg/follow.rs",
        "Xid",
        "kernel log text",
    ),
    ("e2e/tests/nvml_node.rs", "Xid", "kernel log text"),
    ("e2e/tests/monitoring.rs", "Verifying", "a phase"),
    (
        "e2e/tests/api.rs",
        "GpuReset",
        "a rung in a policy's escalation",
    ),
    (
        "e2e/tests/api.rs",
        "NodeReboot",
        "a rung in a policy's escalation",
    ),
    (
        "crates/gpuhealth-api/tests/upgrade.rs",
        "Failed",
        "release 0.1's words, read back",
    ),
    (
        "crates/gpuhealth-api/src/policy.rs",
        "Failed",
        "a phase, in the policy's docs",
    ),
    (
        "crates/gpuhealth-api/tests/upgrade.rs",
        "GpuReset",
        "release 0.1's words, read back",
    ),
    ("e2e/src/pod_resources.rs", "Succeeded", "a pod phase"),
    ("e2e/src/pod_resources.rs", "Failed", "a pod phase"),
    ("e2e/src/bin/gpuhealth-sim.rs", "Succeeded", "a pod phase"),
    ("e2e/src/bin/gpuhealth-sim.rs", "Failed", "a pod phase"),
    (
        "e2e/tests/remediation.rs",
        "Succeeded",
        "the validation pod's phase",
    ),
    (
        "e2e/tests/remediation.rs",
        "Failed",
        "the validation pod's phase",
    ),
    (
        "e2e/tests/monitoring.rs",
        "Failed",
        "a phase, as a metric label",
    ),
    (
        "e2e/tests/monitoring.rs",
        "GpuReset",
        "the action in flight in the operator's log",
    ),
    (
        "e2e/tests/diagnosis.rs",
        "*",
        "the plugin's rendered story, read as a person would",
    ),
    (
        "crates/kubectl-gpuhealth/src/explain/tests.rs",
        "WorkloadNotRecovered",
        "the plugin's rendered story",
    ),
];

fn words() -> Vec<&'static str> {
    let mut all: Vec<&str> = Vec::new();
    all.extend(Reason::ALL.iter().map(|w| w.as_str()));
    all.extend(FindingKind::ALL.iter().map(|w| w.as_str()));
    all.extend(IncidentOutcome::ALL.iter().map(|w| w.as_str()));
    all.extend(WorkloadOutcome::ALL.iter().map(|w| w.as_str()));
    all.extend(AttemptAction::ALL.iter().map(|w| w.as_str()));
    all.extend(AttemptOutcome::ALL.iter().map(|w| w.as_str()));
    all.extend(QuarantineWhy::ALL.iter().map(|w| w.as_str()));
    all
}

fn sources(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        // The words' own module, saved statuses, and this check's list.
        if name == "target"
            || name == "vocabulary"
            || name == "fixtures"
            || name == "vocabulary_words.rs"
        {
            continue;
        }
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Where `text` (the file `file`) spells a status word as a string
/// literal (`"SignalPending"`, or an attempt in words, `"GpuReset#`),
/// outside comments and the allow-list: `file:line: word` each.
fn spelled_in(file: &str, text: &str, words: &[&str]) -> Vec<String> {
    let mut spelled = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("//") {
            continue;
        }
        for word in words {
            let literal = format!("\"{word}\"");
            let attempt = format!("\"{word}#");
            if !line.contains(&literal) && !line.contains(&attempt) {
                continue;
            }
            let allowed = ELSEWHERE
                .iter()
                .any(|(f, w, _)| *f == file && (*w == *word || *w == "*"));
            if !allowed {
                spelled.push(format!("{file}:{}: {word}", n + 1));
            }
        }
    }
    spelled
}

#[test]
fn no_status_word_is_spelled_outside_its_type() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = Vec::new();
    for dir in ["crates", "e2e", "bench", "fuzz/src", "fuzz/fuzz_targets"] {
        sources(&root.join(dir), &mut files);
    }
    assert!(
        files.len() > 50,
        "sources not found under {}",
        root.display()
    );
    let words = words();
    let mut spelled = Vec::new();
    for path in &files {
        let file = path
            .strip_prefix(&root)
            .unwrap_or(path)
            .display()
            .to_string();
        let text = fs::read_to_string(path).unwrap_or_default();
        spelled.extend(spelled_in(&file, &text, &words));
    }
    assert!(
        spelled.is_empty(),
        "status words spelled outside their types (use the type's as_str(), or list the word in ELSEWHERE with why):\n{}",
        spelled.join("\n")
    );
}

/// The check can fail: a literal, or an attempt in words, is found; a
/// comment, a word that is not a status word, and an allowed spot are not.
#[test]
fn the_check_sees_a_spelled_word() {
    let words = words();
    let source = [
        "if reason == \"SignalPending\" {",
        "    // a comment may say \"SignalPending\"",
        "let old = \"GpuReset#2 Failed\";",
        "let other = \"Pending\";",
    ]
    .join("\n");
    assert_eq!(
        spelled_in("crates/x/src/y.rs", &source, &words),
        [
            "crates/x/src/y.rs:1: SignalPending",
            "crates/x/src/y.rs:3: GpuReset"
        ]
    );
    let pod_phase = "matches!(phase, \"Succeeded\")";
    assert!(spelled_in("e2e/src/pod_resources.rs", pod_phase, &words).is_empty());
    assert_eq!(spelled_in("e2e/src/other.rs", pod_phase, &words).len(), 1);
}
