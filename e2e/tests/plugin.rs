//! `kubectl gpuhealth` against the real API server.

use std::time::Duration;

use gpuhealth_e2e::{
    agent::write_report,
    client,
    kubelet::{Kubelet, Start, with_test_kubelet},
    reports,
    scenario::WAIT,
    sim::{
        GpuNodeSpec, gpu_deployment, gpu_node, node_is_ready, pod_is_ready,
        with_incident_startup_probe,
    },
    unique,
    wait::{until, until_set},
};
use k8s_openapi::{
    api::{
        apps::v1::Deployment,
        core::v1::{Namespace, Node, Pod},
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{
    Api, ResourceExt,
    api::{ListParams, PostParams},
    runtime::watcher,
};

async fn plugin(args: &[&str]) -> (bool, String, String) {
    let run = gpuhealth_e2e::plugin::plugin(args).await;
    (run.ok, run.stdout, run.stderr)
}

#[tokio::test]
async fn pods_on_gpu_answers_from_the_agents_report() {
    let client = client().await.expect("client");
    let node = unique("plugin");
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .create(
            &PostParams::default(),
            &gpu_node(&node, &node, &GpuNodeSpec::default()),
        )
        .await
        .expect("node");
    until(nodes.clone(), &node, WAIT, node_is_ready)
        .await
        .expect("Ready");
    // vllm-7 runs on the node; the report also names vllm-7-old, evicted
    // since, which the report has not caught up with.
    let namespace = node.clone();
    Api::<Namespace>::all(client.clone())
        .create(
            &PostParams::default(),
            &Namespace {
                metadata: ObjectMeta {
                    name: Some(namespace.clone()),
                    ..Default::default()
                },
                ..Default::default()
            },
        )
        .await
        .expect("namespace");
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "vllm-7"},
        "spec": {"nodeName": node, "containers": [{"name": "server", "image": "vllm"}]},
    }))
    .expect("pod");
    Api::<Pod>::namespaced(client.clone(), &namespace)
        .create(&PostParams::default(), &pod)
        .await
        .expect("pod");
    let pods: Vec<String> = (0..8).map(|i| format!("vllm-{i}")).collect();
    let mut report = reports::healthy(&namespace, &pods);
    reports::xid_119_and_154(&mut report, 7);
    let mut old = report.gpus[7].pods[0].clone();
    old.name = "vllm-7-old".into();
    report.gpus[7].pods.push(old);
    let uuid = report.gpus[7].uuid.clone();
    write_report(&client, &node, report).await.expect("report");

    // By PCI id, as the kernel log names it.
    let (ok, out, err) = plugin(&["pods-on-gpu", &node, "0000:e1:00"]).await;
    assert!(ok, "{err}");
    assert!(out.contains("ResetRequired"), "{out}");
    assert!(
        out.contains(&format!("  {namespace}/vllm-7 (container server)")),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "({namespace}/vllm-7-old is named by the report but no longer on the node)"
        )),
        "{out}"
    );
    assert!(!out.contains("vllm-6"), "{out}");

    let (ok, out, err) = plugin(&["pods-on-gpu", &node, &uuid, "-o", "json"]).await;
    assert!(ok, "{err}");
    let json: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(
        json["gpu"]["pods"].as_array().map(Vec::len),
        Some(1),
        "{json}"
    );
    assert_eq!(json["gpu"]["pods"][0]["name"], "vllm-7");
    assert_eq!(json["gone"][0]["name"], "vllm-7-old");

    let (ok, _, err) = plugin(&["pods-on-gpu", &node, "GPU-nope"]).await;
    assert!(!ok);
    assert!(err.contains("no GPU"), "{err}");

    let _ = nodes.delete(&node, &Default::default()).await;
    let _ = Api::<Namespace>::all(client)
        .delete(&namespace, &Default::default())
        .await;
}

/// Waits until the pods of `app` in `namespace` satisfy `done`.
async fn wait_pods(client: &kube::Client, namespace: &str, app: &str, done: impl Fn(&Pod) -> bool) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let config = watcher::Config::default().labels(&format!("app={app}"));
    until_set(pods, config, &format!("pods of {app}"), WAIT, |set| {
        !set.is_empty() && set.values().all(&done)
    })
    .await
    .expect("pods");
}

fn restarts(pod: &Pod) -> i32 {
    pod.status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|cs| cs.first())
        .map_or(0, |c| c.restart_count)
}

fn check(json: &str) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_str(json).expect("json");
    v["containers"][0].clone()
}

#[tokio::test]
async fn probe_check_judges_each_workload_from_what_its_pods_showed() {
    let client = client().await.expect("client");
    let group = unique("probes");
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .create(
            &PostParams::default(),
            &gpu_node(&group, &group, &GpuNodeSpec::default()),
        )
        .await
        .expect("node");
    until(nodes.clone(), &group, WAIT, node_is_ready)
        .await
        .expect("Ready");
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(group.clone()),
            ..Default::default()
        },
        ..Default::default()
    };
    let namespaces: Api<Namespace> = Api::all(client.clone());
    namespaces
        .create(&PostParams::default(), &ns)
        .await
        .expect("namespace");
    // The incident's probe (a 330 s window) on three workloads: one starts
    // in 200 s, one is killed at 331 s each time, one never gets a node.
    let kubelet = Kubelet::default();
    kubelet.set(
        "fast",
        Start::Ready {
            cold_start: Duration::from_secs(200),
        },
    );
    kubelet.set(
        "slow",
        Start::StartupProbeLoop {
            killed_after: Duration::from_secs(331),
            restarts: 2,
        },
    );
    let _kubelet = kubelet.spawn(client.clone(), &group);
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &group);
    for app in ["fast", "slow", "stuck"] {
        let mut d = gpu_deployment(&group, app, &group, 1, 1);
        with_incident_startup_probe(&mut d);
        with_test_kubelet(&mut d);
        if app == "stuck"
            && let Some(spec) = d.spec.as_mut().and_then(|s| s.template.spec.as_mut())
        {
            spec.node_selector =
                Some([("gpuhealth.io/no-such-node".to_owned(), "x".to_owned())].into());
        }
        deployments
            .create(&PostParams::default(), &d)
            .await
            .expect("deployment");
    }
    wait_pods(&client, &group, "fast", pod_is_ready).await;
    wait_pods(&client, &group, "slow", |p| restarts(p) == 2).await;
    wait_pods(&client, &group, "stuck", |_| true).await;

    let (ok, out, err) = plugin(&["probe-check", "deploy/fast", "-n", &group, "-o", "json"]).await;
    assert!(ok, "{err}");
    let fast = check(&out);
    assert_eq!(fast["verdict"], "Ok", "{out}");
    assert_eq!(fast["windowSeconds"], 330, "{out}");

    let (ok, out, err) = plugin(&["probe-check", "deploy/slow", "-n", &group, "-o", "json"]).await;
    assert!(ok, "{err}");
    let slow = check(&out);
    assert_eq!(slow["verdict"], "WindowTooShort", "{out}");
    assert_eq!(slow["needsAtLeastSeconds"], 331, "{out}");
    assert_eq!(slow["recommended"]["failureThreshold"], 47, "{out}");
    // The text names the cause and gives the YAML to paste.
    let (ok, out, err) = plugin(&["probe-check", "deployment/slow", "-n", &group]).await;
    assert!(ok, "{err}");
    assert!(out.contains("startupProbe:"), "{out}");
    assert!(out.contains("failureThreshold: 47"), "{out}");
    assert!(out.contains("startup probe"), "{out}");

    // Too little data: Unknown, saying what is missing, for the workload
    // and for its pod alone.
    let (ok, out, err) = plugin(&["probe-check", "deploy/stuck", "-n", &group, "-o", "yaml"]).await;
    assert!(ok, "{err}");
    let stuck: serde_json::Value = serde_yaml::from_str(&out).expect("yaml");
    assert_eq!(stuck["containers"][0]["verdict"], "Unknown", "{out}");
    assert!(
        stuck["containers"][0]["missing"]
            .as_str()
            .is_some_and(|m| m.contains("no pod")),
        "{out}"
    );
    let pods: Api<Pod> = Api::namespaced(client.clone(), &group);
    let stuck_pod = pods
        .list(&ListParams::default().labels("app=stuck"))
        .await
        .expect("pods")
        .items
        .first()
        .map(|p| p.name_any())
        .expect("a stuck pod");
    let (ok, out, err) = plugin(&["probe-check", &stuck_pod, "-n", &group]).await;
    assert!(ok, "{err}");
    assert!(out.contains("Unknown") || out.contains("unknown"), "{out}");

    let (ok, _, err) = plugin(&["probe-check", "deploy/nope", "-n", &group]).await;
    assert!(!ok, "a missing workload is an error");
    assert!(err.contains("nope"), "{err}");

    let _ = namespaces.delete(&group, &Default::default()).await;
    let _ = nodes.delete(&group, &Default::default()).await;
}
