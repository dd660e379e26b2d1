//! The incident, end to end on the real API server: the operator binary, a
//! KWOK GPU node with a vLLM-like Deployment across its eight GPUs, and the
//! fake agent. GPU 7 reports Xid 119 and Xid 154; the node must come back.

use std::{
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures::{StreamExt, TryStreamExt};
use gpuhealth_api::{GpuHealthPolicy, GpuHealthPolicySpec, GpuNodeHealth, node_health::Phase};
use gpuhealth_e2e::{
    agent::{FakeAgent, Request, write_report},
    client, crds,
    operator::Operator,
    reports,
    sim::{GpuNodeSpec, SIM_GROUP_LABEL, gpu_deployment, gpu_node, node_is_ready},
    unique,
    wait::until,
};
use k8s_openapi::{
    api::{
        apps::v1::Deployment,
        core::v1::{Event, Namespace, Node, Pod},
        policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec},
    },
    apimachinery::pkg::{
        apis::meta::v1::{LabelSelector, ObjectMeta},
        util::intstr::IntOrString,
    },
};
use kube::{
    Api, ResourceExt,
    api::{ListParams, PostParams},
    runtime::{WatchStreamExt, watcher},
};

const WAIT: Duration = Duration::from_secs(180);

#[tokio::test]
async fn the_incident_gpu_7_is_reset_and_the_node_returns_to_service() {
    let client = client().await.expect("test cluster");
    crds::install(&client).await.expect("CRDs");
    let started = Instant::now();
    let step = |what: &str| eprintln!("[{:>6.1}s] {what}", started.elapsed().as_secs_f32());

    // An eight-GPU node and eight vLLM pods, one per GPU.
    let group = unique("incident");
    let node_name = format!("{group}-0");
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .create(
            &PostParams::default(),
            &gpu_node(&node_name, &group, &GpuNodeSpec::default()),
        )
        .await
        .expect("node");
    until(nodes.clone(), &node_name, WAIT, node_is_ready)
        .await
        .expect("node Ready");
    let ns = unique("ml-serving");
    let namespace = Namespace {
        metadata: ObjectMeta {
            name: Some(ns.clone()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &namespace)
        .await
        .expect("namespace");
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    deployments
        .create(
            &PostParams::default(),
            &gpu_deployment(&ns, "vllm", &group, 8, 1),
        )
        .await
        .expect("deployment");
    until(deployments.clone(), "vllm", WAIT, |d| {
        d.status.as_ref().and_then(|s| s.ready_replicas) == Some(8)
    })
    .await
    .expect("deployment Ready");
    // One disruption at a time.
    let pdb = PodDisruptionBudget {
        metadata: ObjectMeta {
            name: Some("vllm".into()),
            ..Default::default()
        },
        spec: Some(PodDisruptionBudgetSpec {
            max_unavailable: Some(IntOrString::Int(1)),
            selector: Some(LabelSelector {
                match_labels: Some([("app".into(), "vllm".into())].into()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    Api::<PodDisruptionBudget>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &pdb)
        .await
        .expect("pdb");
    step("node, pods and PDB ready");

    // The agent's view: which pod holds which GPU.
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let mut pod_names: Vec<String> = pods
        .list(&ListParams::default())
        .await
        .expect("pods")
        .iter()
        .map(|p| p.name_any())
        .collect();
    pod_names.sort();
    let mut report = reports::healthy(&ns, &pod_names);
    write_report(&client, &node_name, report.clone())
        .await
        .expect("healthy report");

    let policy_name = unique("incident");
    let mut spec = GpuHealthPolicySpec::for_selector(LabelSelector {
        match_labels: Some([(SIM_GROUP_LABEL.to_owned(), group.clone())].into()),
        ..Default::default()
    });
    // Outranks any policy other tests left behind; verifies quickly.
    spec.priority = 1000;
    spec.verification.stable_for = "5s".parse().expect("duration");
    Api::<GpuHealthPolicy>::all(client.clone())
        .create(
            &PostParams::default(),
            &GpuHealthPolicy::new(&policy_name, spec),
        )
        .await
        .expect("policy");

    let agent = FakeAgent::default();
    let agent_task = agent.spawn(client.clone(), &group);
    let _operator = Operator::start(&format!("operator-{group}"))
        .await
        .expect("operator starts");
    let health: Api<GpuNodeHealth> = Api::all(client.clone());
    until(health.clone(), &node_name, WAIT, |g| {
        g.status.as_ref().is_some_and(|s| s.phase == Phase::Healthy)
    })
    .await
    .expect("the operator takes the node in, Healthy");
    step("operator manages the node");

    // Watch the node for the cordon, to time it.
    let cordoned_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    let cordon_watch = {
        let cordoned_at = cordoned_at.clone();
        let config = watcher::Config::default().fields(&format!("metadata.name={node_name}"));
        let nodes = nodes.clone();
        tokio::spawn(async move {
            let mut stream = watcher(nodes, config)
                .default_backoff()
                .applied_objects()
                .boxed();
            while let Ok(Some(n)) = stream.try_next().await {
                if n.spec.as_ref().and_then(|s| s.unschedulable) == Some(true) {
                    cordoned_at
                        .lock()
                        .map(|mut c| c.get_or_insert_with(Instant::now).to_owned())
                        .ok();
                }
            }
        })
    };

    // GPU 7: Xid 119, then Xid 154 asking for a reset.
    let bad_uuid = report.gpus[7].uuid.clone();
    let bad_pod = pod_names[7].clone();
    reports::xid_119_and_154(&mut report, 7);
    let written = Instant::now();
    write_report(&client, &node_name, report)
        .await
        .expect("bad report");
    step("Xid 119 + 154 reported on GPU 7");

    let done = until(health.clone(), &node_name, WAIT, |g| {
        g.status.as_ref().is_some_and(|s| {
            s.phase == Phase::Healthy
                && s.history
                    .first()
                    .is_some_and(|i| i.outcome.as_deref() == Some("Recovered"))
        })
    })
    .await
    .expect("the node recovers");
    step("node Healthy again");
    cordon_watch.abort();
    agent_task.abort();

    let cordon_latency = cordoned_at
        .lock()
        .ok()
        .and_then(|c| *c)
        .map(|t| t.duration_since(written));
    eprintln!("time from GPU report to cordon: {cordon_latency:?}");
    assert!(cordon_latency.is_some(), "the node was cordoned");

    // Exactly one reset, of exactly GPU 7.
    let requests = agent.requests();
    assert!(
        matches!(requests.as_slice(), [Request::Reset { gpus, .. }] if gpus == &vec![bad_uuid.clone()]),
        "{requests:?}"
    );
    // Only the pod on GPU 7 was evicted; the other seven kept running.
    let remaining: Vec<String> = pods
        .list(&ListParams::default())
        .await
        .expect("pods")
        .iter()
        .map(|p| p.name_any())
        .collect();
    assert!(
        !remaining.contains(&bad_pod),
        "the pod on GPU 7 was evicted"
    );
    for other in &pod_names[..7] {
        assert!(
            remaining.contains(other),
            "{other} kept running: {remaining:?}"
        );
    }
    // Uncordoned, the incident in history, Events for each step.
    let node = nodes.get(&node_name).await.expect("node");
    assert_ne!(
        node.spec.as_ref().and_then(|s| s.unschedulable),
        Some(true),
        "uncordoned"
    );
    let status = done.status.expect("status");
    assert_eq!(status.history[0].actions, ["GpuReset#1 Succeeded"]);
    let events: Vec<String> = Api::<Event>::all(client.clone())
        .list(&ListParams::default().fields(&format!("involvedObject.name={node_name}")))
        .await
        .expect("events")
        .iter()
        .filter_map(|e| e.reason.clone())
        .collect();
    for reason in ["Draining", "ActionRequested", "Verifying", "Recovered"] {
        assert!(
            events.iter().any(|r| r == reason),
            "an Event {reason}: {events:?}"
        );
    }
}
