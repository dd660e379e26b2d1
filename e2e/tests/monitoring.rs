//! The alerts and the dashboard in config/monitoring name only metrics the
//! binaries serve: every `gpuhealth_*` series their expressions use is
//! checked against the `/metrics` of a running operator and agent.

use std::collections::BTreeMap;

use gpuhealth_api::contract::GPU_REPORT_ANNOTATION;
use gpuhealth_e2e::{
    scenario::Scenario,
    sim::{GpuNodeSpec, gpu_node},
};
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api,
    api::{Patch, PatchParams, PostParams},
};
use serde_json::json;

/// `# TYPE name kind` lines: metric family names and their kinds.
fn families(exposition: &str) -> BTreeMap<String, String> {
    exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(n, k)| (n.to_owned(), k.trim().to_owned()))
        .collect()
}

/// Every `gpuhealth_*` name in `text`.
fn names(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("gpuhealth_") {
        let tail = &rest[i..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        out.push(tail[..end].to_owned());
        rest = &tail[end..];
    }
    out
}

/// Whether the series `name` is served by one of `families`.
fn served(name: &str, families: &BTreeMap<String, String>) -> bool {
    let kind = |n: &str| families.get(n).map(String::as_str);
    if kind(name).is_some_and(|k| k == "gauge" || k == "unknown") {
        return true;
    }
    if let Some(base) = name.strip_suffix("_total") {
        return kind(base) == Some("counter");
    }
    ["_bucket", "_sum", "_count"].iter().any(|s| {
        name.strip_suffix(s)
            .is_some_and(|base| kind(base) == Some("histogram"))
    })
}

/// A family shows in `/metrics` once it has a series: the incident, with
/// the real agent binary, makes the operator and agent serve theirs.
#[tokio::test]
async fn alerts_and_dashboard_name_only_served_metrics() {
    let mut s = Scenario::new("monitoring", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    s.start_with_agent_binaries()
        .await
        .expect("operator and agent");
    // A second node of the policy whose detector writes nonsense.
    let nodes: Api<Node> = Api::all(s.client.clone());
    let garbled = format!("{}-garbled", s.group);
    nodes
        .create(
            &PostParams::default(),
            &gpu_node(&garbled, &s.group, &GpuNodeSpec::default()),
        )
        .await
        .expect("node");
    nodes
        .patch(
            &garbled,
            &PatchParams::default(),
            &Patch::Merge(
                json!({"metadata": {"annotations": {GPU_REPORT_ANNOTATION: "{not json"}}}),
            ),
        )
        .await
        .expect("garbled report");
    s.break_gpu(&node, 7).await.expect("break");
    s.wait_recovered(&node).await.expect("recovered");
    s.wait_workloads_judged(&node).await.expect("judged");
    s.wait_event(&garbled, "MalformedGpuReport")
        .await
        .expect("the garbled report seen");

    let mut served_families = BTreeMap::new();
    let agent = s.agent_processes().first().expect("the agent");
    let operator = s.operator.as_ref().expect("the operator");
    for process in [agent, operator] {
        let text = process.scrape().await.expect("/metrics");
        served_families.extend(families(&text));
    }

    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/monitoring");
    for file in ["alerts.yaml", "dashboard.json"] {
        let text = std::fs::read_to_string(format!("{root}/{file}")).expect(file);
        let used = names(&text);
        assert!(used.len() > 5, "{file} names metrics: {used:?}");
        for name in used {
            assert!(
                served(&name, &served_families),
                "{file} uses {name}, which neither binary serves; served: {:?}",
                served_families.keys().collect::<Vec<_>>()
            );
        }
    }
    let _ = nodes.delete(&garbled, &Default::default()).await;
}

#[test]
fn every_alert_has_its_runbook() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
    let alerts = std::fs::read_to_string(format!("{root}/config/monitoring/alerts.yaml"))
        .expect("alerts.yaml");
    let rule: serde_json::Value = serde_yaml::from_str(&alerts).expect("alerts.yaml is YAML");
    assert_eq!(rule["kind"], "PrometheusRule");
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{root}/config/monitoring/dashboard.json"))
            .expect("dashboard.json"),
    )
    .expect("dashboard.json is JSON");
    assert!(dashboard["panels"].as_array().is_some_and(|p| p.len() > 5));
    let names: Vec<&str> = alerts
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert!(names.len() >= 5, "{names:?}");
    for name in names {
        assert!(
            std::path::Path::new(&format!("{root}/docs/runbooks/{name}.md")).exists(),
            "no runbook for {name}"
        );
        assert!(
            alerts.contains(&format!("docs/runbooks/{name}.md")),
            "{name} links its runbook"
        );
    }
}
