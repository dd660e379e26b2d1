//! The metrics after the incident, with their values, and the alerts and
//! the dashboard in config/monitoring naming only metrics the binaries
//! serve: every `gpuhealth_*` series their expressions use is checked
//! against the `/metrics` of a running operator and agent. A node that
//! never reports raises its alert, whose expression is evaluated on a
//! scrape.

use std::{collections::BTreeMap, time::Duration};

use gpuhealth_agent::fake::{SimHardware, SimOutcome};
use gpuhealth_api::{
    contract::{GPU_HEALTHY_CONDITION, GPU_REPORT_ANNOTATION},
    node_health::{GpuNodeHealthStatus, Phase, ReportProblemKind},
    vocabulary::{AttemptAction, AttemptOutcome, FindingKind, IncidentOutcome},
};
use gpuhealth_e2e::{
    alerts::{alert_expr, firing},
    node_agent,
    operator::{self, Options},
    process::Process,
    reports,
    scenario::{Scenario, WAIT},
    sim::{GpuNodeSpec, gpu_node, remove_node},
    unique,
    wait::{until, within},
};
use k8s_openapi::api::{core::v1::Node, policy::v1::PodDisruptionBudget};
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

/// The value of the first series of `name` whose labels include `labels`.
fn value(exposition: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    exposition.lines().find_map(|line| {
        let (series, value) = line.rsplit_once(' ')?;
        let (series_name, rest) = match series.split_once('{') {
            Some((n, rest)) => (n, rest.trim_end_matches('}')),
            None => (series, ""),
        };
        let has = |(k, v): &(&str, &str)| rest.split(',').any(|kv| kv == format!("{k}=\"{v}\""));
        (series_name == name && labels.iter().all(has))
            .then(|| value.parse().ok())
            .flatten()
    })
}

/// Waits, scraping, until `name{labels}` is at least 1.
async fn until_counted(process: &Process, name: &str, labels: &[(&str, &str)]) {
    within(&format!("{name} {labels:?}"), WAIT, async {
        loop {
            let text = process.scrape().await?;
            if value(&text, name, labels).is_some_and(|v| v >= 1.0) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    })
    .await
    .expect("counted");
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

/// The incident, with the real agent binary, behind a PodDisruptionBudget
/// that first refuses the eviction (a 429), next to a node whose detector
/// writes nonsense: every metric then has its series, with the values the
/// incident implies; the alerts and the dashboard use only those.
#[tokio::test]
async fn metrics_tell_the_incident_and_alerts_use_only_served_ones() {
    let mut s = Scenario::new("monitoring", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    s.operator_options.json_logs = true;
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
    s.add_pdb("vllm", 0)
        .await
        .expect("a PDB that allows nothing");
    s.break_gpu(&node, 7).await.expect("break");
    let operator = s.operator.as_ref().expect("the operator");
    let refused = [("action", "evict"), ("outcome", "refused")];
    until_counted(operator, "gpuhealth_actions_total", &refused).await;
    Api::<PodDisruptionBudget>::namespaced(s.client.clone(), &s.namespace)
        .patch(
            "vllm",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"maxUnavailable": 1}})),
        )
        .await
        .expect("the PDB relaxed");
    s.wait_recovered(&node).await.expect("recovered");
    s.wait_workloads_judged(&node).await.expect("judged");
    s.wait_event(&garbled, FindingKind::MalformedGpuReport.as_str())
        .await
        .expect("the garbled report seen");

    let mut served_families = BTreeMap::new();
    let agent = s.agent_processes().first().expect("the agent");
    let operator = s.operator.as_ref().expect("the operator");
    let operator_text = operator.scrape().await.expect("operator /metrics");
    let agent_text = agent.scrape().await.expect("agent /metrics");
    for text in [&operator_text, &agent_text] {
        served_families.extend(families(text));
    }

    // What the incident implies, series by series.
    let policy = s.policy.as_str();
    let o = |name: &str, labels: &[(&str, &str)]| {
        value(&operator_text, name, labels)
            .unwrap_or_else(|| panic!("{name} {labels:?} not served:\n{operator_text}"))
    };
    let actions = "gpuhealth_actions_total";
    for (action, outcome, n) in [
        ("cordon", "done", 1.0),
        ("evict", "done", 1.0),
        ("request_reset", "done", 1.0),
        ("uncordon", "done", 1.0),
    ] {
        let labels = [("action", action), ("outcome", outcome)];
        assert_eq!(o(actions, &labels), n, "{action} {outcome}");
    }
    assert!(o(actions, &refused) >= 1.0, "the 429 is counted");
    assert_eq!(
        value(&operator_text, actions, &[("action", "request_reboot")]),
        None,
        "no reboot"
    );
    let policy_is = ("policy", policy);
    let reset_ok = [
        policy_is,
        ("action", AttemptAction::GpuReset.as_str()),
        ("outcome", AttemptOutcome::Succeeded.as_str()),
    ];
    assert_eq!(o("gpuhealth_remediations_total", &reset_ok), 1.0);
    let recovered = [policy_is, ("outcome", IncidentOutcome::Recovered.as_str())];
    assert_eq!(o("gpuhealth_incidents_total", &recovered), 1.0);
    assert_eq!(o("gpuhealth_time_to_quarantine_seconds_count", &[]), 1.0);
    assert_eq!(o("gpuhealth_time_to_recovery_seconds_count", &[]), 1.0);
    assert!(o("gpuhealth_time_to_recovery_seconds_sum", &[]) > 0.0);
    assert_eq!(
        o("gpuhealth_nodes", &[policy_is, ("phase", "Healthy")]),
        2.0
    );
    assert_eq!(o("gpuhealth_nodes", &[policy_is, ("phase", "Failed")]), 0.0);
    assert_eq!(o("gpuhealth_circuit_open", &[policy_is]), 0.0);
    assert_eq!(o("gpuhealth_policy_unhonoured_fields", &[policy_is]), 0.0);
    assert!(o("gpuhealth_malformed_gpu_reports_total", &[policy_is]) >= 1.0);
    assert!(o("gpuhealth_reconcile_duration_seconds_count", &[]) > 0.0);
    // Every error kind is served from the start, so rate() has a series.
    assert!(o("gpuhealth_reconcile_errors_total", &[]) >= 0.0);
    assert_eq!(o("gpuhealth_leader", &[]), 1.0);
    // What it cost the API server, from the client's side.
    let requests = "gpuhealth_api_requests_total";
    let evictions = [("verb", "create"), ("resource", "pods/eviction")];
    assert_eq!(
        o(requests, &[evictions[0], evictions[1], ("code", "201")]),
        1.0
    );
    assert!(o(requests, &[evictions[0], evictions[1], ("code", "429")]) >= 1.0);
    assert!(o(requests, &[("verb", "patch"), ("resource", "nodes")]) >= 2.0);
    assert!(o(requests, &[("verb", "watch"), ("resource", "nodes")]) >= 1.0);
    let a = |name: &str, labels: &[(&str, &str)]| {
        value(&agent_text, name, labels)
            .unwrap_or_else(|| panic!("{name} {labels:?} not served:\n{agent_text}"))
    };
    assert_eq!(a("gpuhealth_agent_xids_total", &[("code", "119")]), 1.0);
    assert_eq!(a("gpuhealth_agent_xids_total", &[("code", "154")]), 1.0);
    assert_eq!(a("gpuhealth_agent_gpus", &[("health", "Healthy")]), 8.0);
    assert_eq!(
        a("gpuhealth_agent_requests_total", &[("kind", "reset")]),
        1.0
    );
    let agent_patches = [("verb", "patch"), ("resource", "nodes")];
    assert!(a("gpuhealth_agent_api_requests_total", &agent_patches) >= 1.0);

    // Its log, as the Deployment runs it: JSON, one object per line, and a
    // `transition` line per phase change with what an SRE greps for.
    let log = std::fs::read_to_string(&operator.log).expect("the operator's log");
    let lines: Vec<serde_json::Value> = log
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let transitions: Vec<&serde_json::Value> = lines
        .iter()
        .map(|l| &l["fields"])
        .filter(|f| f["message"] == "transition" && f["node"] == node.as_str())
        .collect();
    let phases: Vec<&str> = transitions
        .iter()
        .filter_map(|f| f["phase"].as_str())
        .collect();
    for phase in ["Quarantined", "Remediating", "Verifying", "Healthy"] {
        assert!(
            phases.contains(&phase),
            "a transition to {phase}: {phases:?}"
        );
    }
    let remediating = transitions
        .iter()
        .find(|f| f["phase"] == "Remediating")
        .expect("the transition to Remediating");
    assert_eq!(remediating["policy"], policy);
    assert_eq!(remediating["action"], "GpuReset#1");
    assert!(
        remediating["detail"]
            .as_str()
            .is_some_and(|d| d.contains("requested")),
        "{remediating}"
    );
    assert!(
        remediating["incident"]
            .as_str()
            .is_some_and(|i| !i.is_empty()),
        "{remediating}"
    );

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

/// Scrapes until `name{labels}` reads `want`, then returns that scrape.
async fn until_reads(process: &Process, name: &str, labels: &[(&str, &str)], want: f64) -> String {
    within(&format!("{name} {labels:?} = {want}"), WAIT, async {
        loop {
            let text = process.scrape().await?;
            if value(&text, name, labels) == Some(want) {
                return Ok(text);
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    })
    .await
    .expect("read")
}

/// A node the policy selects and no agent ever reports on: once its grace
/// (`staleAfter`, here a minute) is over it has a `NoReport` finding and
/// Event, its `GpuHealthy` condition is `Unknown`, its phase and its
/// cordon stay as they were, `gpuhealth_nodes_not_reporting` counts it and
/// `GpuHealthNodeNotReporting`'s expression holds for its policy. The
/// agent's first report clears all of it.
#[tokio::test]
async fn a_node_that_never_reports_raises_its_alert_until_it_reports() {
    let mut spec = Scenario::quick_spec();
    spec.detection.gpu_report.stale_after = gpuhealth_api::Duration::from_secs(60);
    let mut s = Scenario::new("silence", 1, spec).await.expect("scenario");
    s.start_operator().await.expect("operator");
    let nodes: Api<Node> = Api::all(s.client.clone());
    let silent = format!("{}-silent", s.group);
    let created = nodes
        .create(
            &PostParams::default(),
            &gpu_node(&silent, &s.group, &GpuNodeSpec::default()),
        )
        .await
        .expect("node");
    let created = created.metadata.creation_timestamp.expect("created").0;
    let no_report =
        |st: &GpuNodeHealthStatus| st.findings.iter().any(|f| f.type_ == FindingKind::NoReport);
    let first = s
        .wait_status(&silent, "taken in", |st| st.policy.is_some())
        .await
        .expect("taken in");
    assert!(!no_report(&first), "within its grace: {:?}", first.findings);
    assert_eq!(first.report_problem, None);

    let said = s
        .wait_status(&silent, "said to have no report", no_report)
        .await
        .expect("said to have none");
    assert_eq!(said.phase, Phase::Healthy);
    assert_eq!(
        said.report_problem.as_ref().map(|p| p.kind),
        Some(ReportProblemKind::Missing)
    );
    let at = said
        .findings
        .iter()
        .find(|f| f.type_ == FindingKind::NoReport)
        .map(|f| f.observed_at.0)
        .expect("the finding");
    // Statuses are written to the second.
    assert!(
        at.duration_since(created) >= k8s_openapi::jiff::SignedDuration::from_secs(59),
        "said at {at}, the node created at {created}: before its grace was over"
    );
    s.wait_event(&silent, FindingKind::NoReport.as_str())
        .await
        .expect("the Event");
    let gpu_healthy = |n: &Node| {
        n.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| cs.iter().find(|c| c.type_ == GPU_HEALTHY_CONDITION))
            .map(|c| (c.status.clone(), c.reason.clone().unwrap_or_default()))
    };
    let node = until(nodes.clone(), &silent, WAIT, |n| {
        gpu_healthy(n) == Some(("Unknown".into(), FindingKind::NoReport.as_str().into()))
    })
    .await
    .expect("GpuHealthy Unknown");
    assert_ne!(
        node.spec.as_ref().and_then(|s| s.unschedulable),
        Some(true),
        "not cordoned"
    );

    let operator = s.operator.as_ref().expect("the operator");
    let policy = [("policy", s.policy.as_str())];
    let gauge = "gpuhealth_nodes_not_reporting";
    let text = until_reads(operator, gauge, &policy, 1.0).await;
    let expr = alert_expr("GpuHealthNodeNotReporting");
    let fires_for_it = |text: &str| {
        firing(&expr, text)
            .iter()
            .any(|g| g.get("policy").map(String::as_str) == Some(s.policy.as_str()))
    };
    assert!(
        fires_for_it(&text),
        "{expr} holds for {}:\n{text}",
        s.policy
    );

    // An agent starts there and reports.
    let hardware = SimHardware {
        gpus: reports::healthy(&s.namespace, &[]).gpus,
        reset: SimOutcome::Succeed,
        reboot: SimOutcome::Succeed,
        reset_takes: None,
        executed: Vec::new(),
        capabilities: None,
    };
    node_agent::set_hardware(&s.client, &silent, &hardware)
        .await
        .expect("hardware");
    let state = std::env::temp_dir().join(format!("gpuhealth-agent-{silent}"));
    let _ = std::fs::remove_dir_all(&state);
    let mut agent = node_agent::start(&format!("{silent}-agent"), &silent, &state, None)
        .await
        .expect("the agent");
    let cleared = s
        .wait_status(&silent, "cleared by the first report", |st| {
            !no_report(st) && st.report_problem.is_none()
        })
        .await
        .expect("cleared");
    assert_eq!(cleared.phase, Phase::Healthy);
    until(nodes.clone(), &silent, WAIT, |n| {
        gpu_healthy(n).is_some_and(|(status, _)| status == "True")
    })
    .await
    .expect("the agent's own GpuHealthy");
    let text = until_reads(operator, gauge, &policy, 0.0).await;
    assert!(!fires_for_it(&text), "{expr} no longer holds:\n{text}");

    agent.kill().await;
    remove_node(&s.client, &silent).await;
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

/// `/livez` says the process answers; `/readyz` that it can act: its caches
/// are synced from the API server and it has joined the leader election.
/// With an API server that refuses connections, it lives and is not ready.
#[tokio::test]
async fn livez_answers_and_readyz_waits_for_the_api_server() {
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a port");
        listener.local_addr().expect("its address")
    };
    let kubeconfig = std::env::temp_dir().join(format!("{}.kubeconfig", unique("unreachable")));
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: c\n  cluster:\n    server: https://{closed}\n    insecure-skip-tls-verify: true\nusers:\n- name: u\n  user:\n    token: nothing\ncontexts:\n- name: x\n  context: {{cluster: c, user: u}}\ncurrent-context: x\n"
        ),
    )
    .expect("kubeconfig");
    let cut_off = operator::start_with(
        &unique("operator-cut-off"),
        Options {
            kubeconfig: Some(kubeconfig),
            ..Default::default()
        },
    )
    .await
    .expect("operator");
    let (status, _) = cut_off
        .get("/livez", |s| s == 200)
        .await
        .expect("/livez answers");
    assert_eq!(status, 200);
    let (status, body) = cut_off
        .get("/readyz", |_| true)
        .await
        .expect("/readyz answers");
    assert_eq!(status, 503, "not ready without its caches: {body}");
    assert!(body.contains("caches"), "{body}");

    let connected = operator::start(&unique("operator-connected"))
        .await
        .expect("operator");
    connected
        .get("/readyz", |s| s == 200)
        .await
        .expect("ready once its caches are synced");
    let (status, _) = cut_off
        .get("/readyz", |_| true)
        .await
        .expect("/readyz answers");
    assert_eq!(status, 503, "still not ready");
}
