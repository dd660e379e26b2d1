//! Diagnosis end to end on the real API server: pods taken out of traffic
//! by their readiness gate while their GPU is bad, and the incident's second
//! half: after the reset, the evicted vLLM pod comes back into a startup
//! probe loop, which gpuhealth reports as a probe problem, not a GPU failure.

use std::time::Duration;

use gpuhealth_api::{
    GpuHealth,
    contract::GPU_HEALTHY_READINESS_GATE,
    node_health::Phase,
    vocabulary::{FindingKind, WorkloadOutcome},
};
use gpuhealth_e2e::{
    kubelet::{Kubelet, Start, with_test_kubelet},
    plugin::plugin,
    reports,
    scenario::{Scenario, WAIT},
    sim::{
        GPU_RESOURCE, SIM_GROUP_LABEL, is_cordoned, pod_is_ready, with_gpu_gate,
        with_incident_startup_probe,
    },
    wait::until,
};
use k8s_openapi::{
    api::core::v1::{Container, Pod, PodSpec, ResourceRequirements},
    apimachinery::pkg::{
        api::resource::Quantity,
        apis::meta::v1::{LabelSelector, LabelSelectorRequirement, ObjectMeta},
    },
};
use kube::{Api, api::PostParams};

fn gate_of(pod: &Pod) -> Option<String> {
    pod.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == GPU_HEALTHY_READINESS_GATE)
        .map(|c| c.status.clone())
}

/// A pod holding one GPU of the scenario's nodes, without the gate.
fn plain_pod(namespace: &str, group: &str) -> Pod {
    let gpu = [(GPU_RESOURCE.to_owned(), Quantity("1".into()))].into();
    Pod {
        metadata: ObjectMeta {
            name: Some("plain".into()),
            namespace: Some(namespace.into()),
            labels: Some([("app".to_owned(), "plain".to_owned())].into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_selector: Some([(SIM_GROUP_LABEL.to_owned(), group.to_owned())].into()),
            termination_grace_period_seconds: Some(1),
            containers: vec![Container {
                name: "server".into(),
                image: Some("vllm/vllm-openai:latest".into()),
                resources: Some(ResourceRequirements {
                    limits: Some(gpu),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[tokio::test]
async fn a_gated_pod_leaves_traffic_while_its_gpu_is_bad_and_returns_after_recovery() {
    let mut spec = Scenario::quick_spec();
    // Both pods on the bad GPUs are excluded from the drain: never
    // evicted, they hold the reset back while they hold the GPUs.
    spec.drain.exclude_pod_selector = Some(LabelSelector {
        match_expressions: Some(vec![LabelSelectorRequirement {
            key: "app".into(),
            operator: "In".into(),
            values: Some(vec!["vllm".into(), "plain".into()]),
        }]),
        ..Default::default()
    });
    // Seven gated vLLM pods, and room for one pod without the gate.
    let mut s = Scenario::new_with(
        "gate",
        1,
        spec,
        |d| {
            with_gpu_gate(d);
            if let Some(spec) = d.spec.as_mut() {
                spec.replicas = Some(7);
            }
        },
        None,
    )
    .await
    .expect("scenario");
    let node = s.nodes[0].clone();
    let pods: Api<Pod> = Api::namespaced(s.client.clone(), &s.namespace);
    pods.create(&PostParams::default(), &plain_pod(&s.namespace, &s.group))
        .await
        .expect("plain pod");
    until(pods.clone(), "plain", WAIT, pod_is_ready)
        .await
        .expect("plain Ready");
    s.start().await.expect("operator");

    // GPU 0 held by `plain` (no gate), GPU 7 by a gated vLLM pod.
    let holders = s.pods_on(&node).await.expect("pods");
    assert_eq!(holders[0], "plain", "{holders:?}");
    let (gated, healthy_neighbour) = (holders[7].clone(), holders[3].clone());
    let mut report = reports::healthy(&s.namespace, &holders);
    reports::xid_119_and_154(&mut report, 0);
    reports::xid_119_and_154(&mut report, 7);
    s.write_report(&node, report).await.expect("report");

    let out = until(pods.clone(), &gated, WAIT, |p| {
        gate_of(p).as_deref() == Some("False") && !pod_is_ready(p)
    })
    .await
    .expect("the gated pod on GPU 7 leaves traffic");
    assert_eq!(gate_of(&out).as_deref(), Some("False"));
    s.wait_event(&gated, FindingKind::PodOnBadGpu.as_str())
        .await
        .expect("its Event");
    s.wait_event("plain", FindingKind::PodOnBadGpu.as_str())
        .await
        .expect("the pod without the gate gets the finding's Event");
    let plain = pods.get("plain").await.expect("plain");
    assert!(pod_is_ready(&plain), "without the gate it stays Ready");
    assert_eq!(
        gate_of(&plain),
        None,
        "and gpuhealth writes no condition on it"
    );
    let neighbour = pods.get(&healthy_neighbour).await.expect("neighbour");
    assert_eq!(gate_of(&neighbour).as_deref(), Some("True"));
    assert!(
        pod_is_ready(&neighbour),
        "a pod on a healthy GPU keeps serving"
    );

    // The reset waits on them, and says so.
    s.wait_status(&node, "the reset held back by the excluded pods", |st| {
        st.phase == Phase::Draining
            && st
                .message
                .as_deref()
                .is_some_and(|m| m.contains("excludePodSelector"))
    })
    .await
    .expect("held back");
    // Both pods let go of their GPUs (the report names them on none), as
    // pods whose processes exit would: no pod holds a GPU the reset acts
    // on, and it runs without evicting them. The reset of GPUs 0 and 7,
    // verification, uncordon: the gate comes back.
    let mut report = reports::healthy(&s.namespace, &holders);
    reports::xid_119_and_154(&mut report, 0);
    reports::xid_119_and_154(&mut report, 7);
    for gpu in [0, 7] {
        report.gpus[gpu].pods.clear();
    }
    s.write_report(&node, report).await.expect("report");
    let status = s.wait_recovered(&node).await.expect("recovered");
    assert!(
        status
            .findings
            .iter()
            .any(|f| f.type_ == FindingKind::PodOnBadGpu
                && f.subject.as_ref().map(ToString::to_string)
                    == Some(format!("{}/plain", s.namespace))),
        "{:?}",
        status.findings
    );
    until(pods.clone(), &gated, WAIT, |p| {
        gate_of(p).as_deref() == Some("True") && pod_is_ready(p)
    })
    .await
    .expect("the gated pod is Ready again after recovery");
}

#[tokio::test]
async fn the_incidents_second_half_a_startup_probe_loop_is_a_probe_problem_not_a_gpu_failure() {
    let mut spec = Scenario::quick_spec();
    spec.verification.workload_recovery_timeout = gpuhealth_api::Duration::from_secs(20);
    // The vLLM pods start as the test's kubelet says: 250 s to Ready.
    let kubelet = Kubelet::default();
    kubelet.set(
        "vllm",
        Start::Ready {
            cold_start: Duration::from_secs(250),
        },
    );
    let mut s = Scenario::new_with(
        "probe-loop",
        1,
        spec,
        |d| {
            with_incident_startup_probe(d);
            with_test_kubelet(d);
        },
        Some(&kubelet),
    )
    .await
    .expect("scenario");
    let node = s.nodes[0].clone();
    s.start().await.expect("operator");
    let before = s.pods_on(&node).await.expect("pods");

    s.break_gpu(&node, 7).await.expect("Xid 119 + 154 on GPU 7");
    until(
        Api::<k8s_openapi::api::core::v1::Node>::all(s.client.clone()),
        &node,
        WAIT,
        is_cordoned,
    )
    .await
    .expect("cordoned");
    // From now on the vLLM pod's cold start outlasts its 330 s window: the
    // replacement, scheduled after uncordon, is killed at 331 s, again and again.
    kubelet.set(
        "vllm",
        Start::StartupProbeLoop {
            killed_after: Duration::from_secs(331),
            restarts: 2,
        },
    );
    s.wait_recovered(&node).await.expect("the GPU is reset");

    let status = s.wait_workloads_judged(&node).await.expect("judged");
    let watch = status.history[0].workloads.clone().expect("workloads");
    assert_eq!(
        watch.outcome,
        Some(WorkloadOutcome::WorkloadNotRecovered),
        "{watch:?}"
    );
    let message = watch.message.unwrap_or_default();
    assert!(message.contains("killed by its startup probe"), "{message}");
    assert!(
        message.contains("startup window 330s is shorter than its cold start (at least 331s)"),
        "{message}"
    );
    let probe = status
        .findings
        .iter()
        .find(|f| f.type_ == FindingKind::StartupProbeTooShort)
        .expect("a StartupProbeTooShort finding");
    assert!(
        probe
            .message
            .contains("set startupProbe.failureThreshold to 47"),
        "covers 331 s with half again to spare: {}",
        probe.message
    );
    assert!(
        status
            .findings
            .iter()
            .any(|f| f.type_ == FindingKind::WorkloadNotRecovered)
    );
    let after = s.pods_on(&node).await.expect("pods");
    let replacement = after
        .iter()
        .find(|p| !before.contains(p))
        .expect("the evicted pod's replacement");
    s.wait_event(replacement, FindingKind::StartupProbeTooShort.as_str())
        .await
        .expect("the finding is told to the pod");

    // The plugin says the same: the probe check of the Deployment with the
    // YAML to paste, and the node's whole story.
    let check = plugin(&["probe-check", "deploy/vllm", "-n", &s.namespace]).await;
    assert!(check.ok, "{}", check.stderr);
    for expected in [
        "WindowTooShort",
        "= 330s",
        "startupProbe:",
        "failureThreshold: 47",
        "killed by its startup probe",
    ] {
        assert!(
            check.stdout.contains(expected),
            "{expected}: {}",
            check.stdout
        );
    }
    let story = plugin(&["explain", &node]).await;
    assert!(story.ok, "{}", story.stderr);
    for expected in [
        "Xid 119 on GPU 7",
        "Xid 154 on GPU 7",
        "ActionRequested",
        "GpuReset#1 Succeeded",
        "Recovered",
        "WorkloadNotRecovered",
        "StartupProbeTooShort",
        "What to do next",
        "probe-check",
    ] {
        assert!(
            story.stdout.contains(expected),
            "{expected}: {}",
            story.stdout
        );
    }
    let fleet = plugin(&["status", "-o", "json"]).await;
    assert!(fleet.ok, "{}", fleet.stderr);
    let json: serde_json::Value = serde_json::from_str(&fleet.stdout).expect("json");
    assert!(json.to_string().contains(&node), "{}", fleet.stdout);

    // A probe problem, not a GPU failure: no second incident, no second reset.
    assert_eq!(status.phase, Phase::Healthy);
    assert_eq!(status.history.len(), 1, "{:?}", status.history);
    assert_eq!(s.agent.requests().len(), 1, "{:?}", s.agent.requests());
    assert!(!is_cordoned(&s.node(&node).await.expect("node")));
    let gpus = status
        .gpus
        .iter()
        .filter(|g| g.health != GpuHealth::Healthy)
        .count();
    assert_eq!(gpus, 0);
}
