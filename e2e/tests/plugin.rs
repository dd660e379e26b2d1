//! `kubectl gpuhealth` against the real API server.

use gpuhealth_e2e::{
    agent::write_report,
    client,
    cluster::kubeconfig_path,
    process::built,
    reports,
    scenario::WAIT,
    sim::{GpuNodeSpec, gpu_node, node_is_ready},
    unique,
    wait::until,
};
use k8s_openapi::api::core::v1::Node;
use kube::{Api, api::PostParams};

async fn plugin(args: &[&str]) -> (bool, String, String) {
    let out = tokio::process::Command::new(built("kubectl-gpuhealth"))
        .env("KUBECONFIG", kubeconfig_path().await.expect("kubeconfig"))
        .args(args)
        .output()
        .await
        .expect("run kubectl-gpuhealth (cargo build -p kubectl-gpuhealth)");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
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
    let pods: Vec<String> = (0..8).map(|i| format!("vllm-{i}")).collect();
    let mut report = reports::healthy("ml-serving", &pods);
    reports::xid_119_and_154(&mut report, 7);
    let uuid = report.gpus[7].uuid.clone();
    write_report(&client, &node, report).await.expect("report");

    // By PCI id, as the kernel log names it.
    let (ok, out, err) = plugin(&["pods-on-gpu", &node, "0000:e1:00"]).await;
    assert!(ok, "{err}");
    assert!(out.contains("ResetRequired"), "{out}");
    assert!(out.contains("ml-serving/vllm-7"), "{out}");
    assert!(!out.contains("vllm-6"), "{out}");

    let (ok, out, err) = plugin(&["pods-on-gpu", &node, &uuid, "-o", "json"]).await;
    assert!(ok, "{err}");
    let json: serde_json::Value = serde_json::from_str(&out).expect("json");
    assert_eq!(json["gpu"]["pods"][0]["name"], "vllm-7");

    let (ok, _, err) = plugin(&["pods-on-gpu", &node, "GPU-nope"]).await;
    assert!(!ok);
    assert!(err.contains("no GPU"), "{err}");

    let _ = nodes.delete(&node, &Default::default()).await;
}
