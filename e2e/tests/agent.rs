//! The real `gpuhealth-agent` binary (fake backend) on a simulated node,
//! against the real API server: it publishes what the hardware says, only
//! when it changes, and carries out each request at most once, across
//! restarts too.

use std::{
    collections::BTreeSet,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Instant,
};

use futures::StreamExt;
use gpuhealth_agent::backend::{SimHardware, SimOutcome};
use gpuhealth_api::{
    GpuHealth,
    contract::{
        AnnotationValue, GPU_HEALTHY_CONDITION, GPU_REPORT_ANNOTATION, GpuReport, Outcome,
        REQUEST_RESULT_ANNOTATION, RESET_REQUEST_ANNOTATION, RequestResult, ResetRequest,
    },
};
use gpuhealth_e2e::{
    client,
    node_agent::{self, hardware, set_hardware},
    reports,
    scenario::WAIT,
    sim::{GpuNodeSpec, gpu_node, node_is_ready},
    unique,
    wait::{Background, applied, until},
};
use k8s_openapi::{
    api::core::v1::Node,
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::{SignedDuration, Timestamp},
};
use kube::{
    Api, Client, ResourceExt,
    api::{Patch, PatchParams, PostParams},
    runtime::watcher,
};
use serde_json::json;

/// A Ready simulated node with eight healthy GPUs, and a fresh state dir.
async fn node(name: &str) -> (Client, String, PathBuf) {
    let client = client().await.expect("client");
    let node = unique(name);
    let api: Api<Node> = Api::all(client.clone());
    api.create(
        &PostParams::default(),
        &gpu_node(&node, &node, &GpuNodeSpec::default()),
    )
    .await
    .expect("node");
    until(api, &node, WAIT, node_is_ready).await.expect("Ready");
    set_hardware(&client, &node, &healthy())
        .await
        .expect("hardware");
    let state = std::env::temp_dir().join(format!("gpuhealth-agent-{node}"));
    let _ = std::fs::remove_dir_all(&state);
    (client, node, state)
}

/// Removes a test's node: one left with a broken GPU in its report would be
/// remediated by the operators of later tests.
async fn remove(client: &Client, node: &str) {
    let _ = Api::<Node>::all(client.clone())
        .delete(node, &Default::default())
        .await;
}

fn healthy() -> SimHardware {
    SimHardware {
        gpus: reports::healthy("serving", &[]).gpus,
        reset: SimOutcome::Succeed,
        reboot: SimOutcome::Succeed,
        executed: Vec::new(),
    }
}

fn report(n: &Node) -> Option<GpuReport> {
    GpuReport::parse(n.annotations().get(GPU_REPORT_ANNOTATION)?).ok()
}

fn result(n: &Node) -> Option<RequestResult> {
    RequestResult::parse(n.annotations().get(REQUEST_RESULT_ANNOTATION)?).ok()
}

fn gpu_healthy_condition(n: &Node) -> Option<String> {
    n.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == GPU_HEALTHY_CONDITION)
        .map(|c| c.status.clone())
}

async fn request_reset(client: &Client, node: &str, id: &str, gpu: &str, at: Timestamp) {
    let request = ResetRequest {
        id: id.parse().expect("id"),
        gpus: vec![gpu.to_owned()],
        requested_at: Time(at),
    };
    let patch =
        json!({"metadata": {"annotations": {RESET_REQUEST_ANNOTATION: request.to_annotation()}}});
    Api::<Node>::all(client.clone())
        .patch(node, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .expect("request");
}

async fn answered(client: &Client, node: &str, id: &str) -> (Node, RequestResult) {
    let n = until(Api::<Node>::all(client.clone()), node, WAIT, |n| {
        result(n).is_some_and(|r| r.id.to_string() == id)
    })
    .await
    .unwrap_or_else(|e| panic!("an answer to {id}: {e}"));
    let r = result(&n).expect("result");
    (n, r)
}

#[tokio::test]
async fn the_report_follows_the_hardware_and_is_written_only_on_change() {
    let (client, node, state) = node("agent-report").await;
    let agent = node_agent::start(&format!("{node}-agent"), &node, &state, None)
        .await
        .expect("agent");
    let nodes: Api<Node> = Api::all(client.clone());
    until(nodes.clone(), &node, WAIT, |n| {
        report(n).is_some_and(|r| {
            r.gpus.len() == 8 && r.source.as_deref() == Some("gpuhealth-agent/fake")
        }) && gpu_healthy_condition(n).as_deref() == Some("True")
    })
    .await
    .expect("the first report and GpuHealthy=True");

    // Every distinct report value the Node ever carries from now on.
    let values: Arc<Mutex<BTreeSet<String>>> = Arc::default();
    let recorder = {
        let values = values.clone();
        let config = watcher::Config::default().fields(&format!("metadata.name={node}"));
        Background::spawn({
            let nodes = nodes.clone();
            async move {
                let mut stream = std::pin::pin!(applied(nodes, config));
                while let Some(n) = stream.next().await {
                    if let (Some(v), Ok(mut set)) =
                        (n.annotations().get(GPU_REPORT_ANNOTATION), values.lock())
                    {
                        set.insert(v.clone());
                    }
                }
            }
        })
    };
    // Changes to the Node that are not the hardware: each wakes the agent,
    // and none may make it write.
    for i in 0..5 {
        let patch = json!({"metadata": {"annotations": {"e2e.gpuhealth.io/touch": i.to_string()}}});
        nodes
            .patch(&node, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .expect("touch");
    }
    let mut broken = healthy();
    broken.gpus[6].health = GpuHealth::ResetRequired;
    broken.gpus[6].recovery_action = Some(1);
    let changed = Instant::now();
    set_hardware(&client, &node, &broken)
        .await
        .expect("GPU 6 breaks");
    let n = until(nodes.clone(), &node, WAIT, |n| {
        report(n).is_some_and(|r| r.gpus[6].health == GpuHealth::ResetRequired)
    })
    .await
    .expect("the report shows it");
    let latency = changed.elapsed();
    eprintln!("hardware change to report on the Node: {latency:?}");
    until(nodes, &node, WAIT, |n| {
        gpu_healthy_condition(n).as_deref() == Some("False")
    })
    .await
    .expect("GpuHealthy=False");
    drop(recorder);
    let seen = values.lock().map(|v| v.len()).unwrap_or_default();
    assert_eq!(
        seen, 2,
        "one write for the change and none for the five other Node updates"
    );
    assert_eq!(report(&n).map(|r| r.bad_gpus().count()), Some(1));
    let metrics = agent.scrape().await.expect("metrics");
    for line in [
        "gpuhealth_agent_report_writes_total 2",
        "gpuhealth_agent_gpus{health=\"ResetRequired\"} 1",
        "gpuhealth_agent_gpus{health=\"Healthy\"} 7",
    ] {
        assert!(metrics.contains(line), "{line} in:\n{metrics}");
    }
    remove(&client, &node).await;
}

#[tokio::test]
async fn a_request_is_carried_out_once_and_repeated_or_stale_ones_are_not() {
    let (client, node, state) = node("agent-requests").await;
    let mut hw = healthy();
    hw.gpus[7].health = GpuHealth::ResetRequired;
    hw.gpus[7].recovery_action = Some(1);
    set_hardware(&client, &node, &hw)
        .await
        .expect("GPU 7 needs a reset");
    let gpu7 = hw.gpus[7].uuid.clone();
    let _agent = node_agent::start(&format!("{node}-agent"), &node, &state, None)
        .await
        .expect("agent");

    request_reset(&client, &node, "inc-1-reset-1", &gpu7, Timestamp::now()).await;
    let (n, r) = answered(&client, &node, "inc-1-reset-1").await;
    assert_eq!(r.outcome, Outcome::Succeeded, "{r:?}");
    assert_eq!(
        hardware(&n).map(|h| h.executed),
        Some(vec!["inc-1-reset-1".to_owned()])
    );
    until(Api::<Node>::all(client.clone()), &node, WAIT, |n| {
        report(n).is_some_and(|r| r.bad_gpus().next().is_none())
    })
    .await
    .expect("GPU 7 healthy again in the report");

    // The same id again (a re-issued annotation), then a stale request: the
    // stale one is answered, neither is carried out.
    request_reset(&client, &node, "inc-1-reset-1", &gpu7, Timestamp::now()).await;
    let two_hours_ago = Timestamp::now() - SignedDuration::from_hours(2);
    request_reset(&client, &node, "inc-2-reset-1", &gpu7, two_hours_ago).await;
    let (n, r) = answered(&client, &node, "inc-2-reset-1").await;
    assert_eq!(r.outcome, Outcome::Refused, "{r:?}");
    assert!(r.message.contains("request-max-age"), "{}", r.message);
    assert_eq!(
        hardware(&n).map(|h| h.executed),
        Some(vec!["inc-1-reset-1".to_owned()]),
        "nothing carried out twice, nothing stale carried out"
    );
    remove(&client, &node).await;
}

#[tokio::test]
async fn an_agent_restarted_mid_request_never_carries_it_out_twice() {
    let (client, node, state) = node("agent-restart").await;
    let gpu7 = healthy().gpus[7].uuid.clone();

    // Dies after carrying it out, before writing the result.
    let mut first = node_agent::start(&format!("{node}-finished"), &node, &state, Some("finished"))
        .await
        .expect("agent");
    request_reset(&client, &node, "inc-3-reset-1", &gpu7, Timestamp::now()).await;
    let exit = first.exited(WAIT).await.expect("the crash");
    assert_eq!(exit.code(), Some(3));
    let nodes: Api<Node> = Api::all(client.clone());
    let n = nodes.get(&node).await.expect("node");
    assert!(result(&n).is_none(), "no result written before the crash");
    let _second = node_agent::start(&format!("{node}-after-finished"), &node, &state, None)
        .await
        .expect("agent");
    let (n, r) = answered(&client, &node, "inc-3-reset-1").await;
    assert_eq!(r.outcome, Outcome::Succeeded, "the journalled result");
    assert_eq!(
        hardware(&n).map(|h| h.executed),
        Some(vec!["inc-3-reset-1".to_owned()])
    );
    drop(_second);

    // Dies after journalling the start, before carrying it out.
    let mut third = node_agent::start(&format!("{node}-begun"), &node, &state, Some("begun"))
        .await
        .expect("agent");
    request_reset(&client, &node, "inc-4-reset-1", &gpu7, Timestamp::now()).await;
    assert_eq!(third.exited(WAIT).await.expect("the crash").code(), Some(3));
    let _fourth = node_agent::start(&format!("{node}-after-begun"), &node, &state, None)
        .await
        .expect("agent");
    let (n, r) = answered(&client, &node, "inc-4-reset-1").await;
    assert_eq!(r.outcome, Outcome::Failed, "{r:?}");
    assert!(r.message.contains("not repeated"), "{}", r.message);
    assert_eq!(
        hardware(&n).map(|h| h.executed),
        Some(vec!["inc-3-reset-1".to_owned()]),
        "the interrupted request was not carried out afterwards"
    );
    remove(&client, &node).await;
}

#[tokio::test]
async fn without_nvml_the_agent_reports_from_the_kernel_log() {
    // This machine has no NVIDIA driver: the nvml backend cannot load, and
    // the agent falls back to the kernel log (a file standing in for /dev/kmsg).
    let (client, node, state) = node("agent-kmsg").await;
    let kmsg = state.with_extension("kmsg");
    let lines = [
        "6,100,1000000,-;NVRM: GPU at PCI:0000:e1:00: GPU-0a1b2c3d-0000-4000-8000-000000000007",
        "6,101,1000100,-;NVRM: GPU at PCI:0000:01:00: GPU-0a1b2c3d-0000-4000-8000-000000000000",
    ];
    std::fs::write(&kmsg, lines.join("\n") + "\n").expect("kernel log");
    let kmsg_arg = kmsg.display().to_string();
    let args = ["--backend", "nvml", "--kmsg-path", kmsg_arg.as_str()];
    let agent = node_agent::start_with(&format!("{node}-agent"), &node, &state, None, &args)
        .await
        .expect("agent");
    let nodes: Api<Node> = Api::all(client.clone());
    until(nodes.clone(), &node, WAIT, |n| {
        report(n).is_some_and(|r| {
            r.source.as_deref() == Some("gpuhealth-agent/kmsg")
                && r.gpus.len() == 2
                && r.bad_gpus().next().is_none()
        })
    })
    .await
    .expect("a healthy report from the log");

    // The incident's lines, appended as the driver would log them.
    use std::io::Write;
    let mut log = std::fs::OpenOptions::new()
        .append(true)
        .open(&kmsg)
        .expect("open");
    writeln!(log, "4,102,2000000,-;NVRM: Xid (PCI:0000:e1:00): 119, Timeout after 45s of waiting for RPC response from GPU GSP").expect("append");
    writeln!(log, "4,103,2000100,-;NVRM: Xid (PCI:0000:e1:00): 154, GPU recovery action changed from None to GPU Reset Required").expect("append");
    let n = until(nodes, &node, WAIT, |n| {
        report(n)
            .is_some_and(|r| r.bad_gpus().count() == 1 && r.bad_gpus().all(|g| g.xids.len() == 2))
    })
    .await
    .expect("GPU 7 reported from the log");
    let r = report(&n).expect("report");
    let bad = r.bad_gpus().next().expect("the bad GPU");
    assert_eq!(bad.uuid, "GPU-0a1b2c3d-0000-4000-8000-000000000007");
    assert_eq!(bad.health, GpuHealth::ResetRequired);
    assert_eq!(bad.recovery_action, Some(1));
    assert_eq!(
        bad.xids.iter().map(|x| x.code).collect::<Vec<_>>(),
        [119, 154]
    );
    let metrics = agent.scrape().await.expect("metrics");
    for code in [119, 154] {
        let line = format!("gpuhealth_agent_xids_total{{code=\"{code}\"}} 1");
        assert!(metrics.contains(&line), "{line} in:\n{metrics}");
    }

    // Told NVML is required, the agent exits non-zero instead.
    let mut strict = node_agent::start_with(
        &format!("{node}-strict"),
        &node,
        &state.with_extension("strict"),
        None,
        &[
            "--backend",
            "nvml",
            "--require-nvml",
            "--kmsg-path",
            kmsg_arg.as_str(),
        ],
    )
    .await
    .expect("agent");
    let exit = strict.exited(WAIT).await.expect("exits");
    assert!(!exit.success(), "{exit:?}");
    remove(&client, &node).await;
}
