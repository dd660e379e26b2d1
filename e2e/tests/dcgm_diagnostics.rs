//! DCGM diagnostics before a repaired GPU serves again, end to end: the real
//! operator and the real agent binary (NVML backend over the host's
//! stand-ins), with `dcgmi` stood in at its own boundary
//! (`e2e/dcgmi-standin`): the executor runs it as it runs NVIDIA's. A pass
//! returns the GPU; a failure, and a diagnostic that hangs past its time,
//! are failed attempts, and the next rung follows; the node is never
//! uncordoned on either.

use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
};

use gpuhealth_api::{
    RecoveryAction,
    contract::{
        AnnotationValue, DiagnosticsLevel, DiagnosticsVerdict, GPU_REPORT_ANNOTATION, GpuReport,
        TestVerdict,
    },
    node_health::Phase,
    policy::Diagnostics,
    vocabulary::{AttemptAction, AttemptOutcome},
};
use gpuhealth_e2e::{
    host::{Agent, Host, uuid},
    scenario::{Scenario, WAIT},
    sim::{is_cordoned, remove_node},
    wait::until,
};
use k8s_openapi::{api::core::v1::Node, apimachinery::pkg::util::intstr::IntOrString};
use kube::{Api, ResourceExt};

const STANDIN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/dcgmi-standin/dcgmi");

/// A `dcgmi` for one node: the stand-in, told `verdict` by its behaviour
/// file (the agent's environment is the shipped one, so the file is named
/// here).
fn dcgmi_for(dir: &Path, verdict: &str) -> PathBuf {
    std::fs::create_dir_all(dir).expect("the dcgmi directory");
    let behaviour = dir.join("behaviour");
    std::fs::write(&behaviour, verdict).expect("the stand-in's behaviour");
    let dcgmi = dir.join("dcgmi");
    std::fs::write(
        &dcgmi,
        format!(
            "#!/bin/sh\nGPUHEALTH_DCGMI_STANDIN_FILE={} exec {STANDIN} \"$@\"\n",
            behaviour.display()
        ),
    )
    .expect("the dcgmi wrapper");
    std::fs::set_permissions(&dcgmi, std::fs::Permissions::from_mode(0o755)).expect("executable");
    dcgmi
}

#[tokio::test]
async fn a_repaired_gpu_serves_again_only_once_dcgm_passes_it() {
    let mut spec = Scenario::quick_spec();
    spec.max_concurrent = IntOrString::Int(3);
    spec.max_unhealthy = IntOrString::Int(3);
    spec.verification.diagnostics = Diagnostics {
        level: DiagnosticsLevel::Quick,
        timeout: gpuhealth_api::Duration::from_secs(30),
    };
    let mut s = Scenario::new("dcgm-e2e", 3, spec).await.expect("scenario");
    let nodes: Api<Node> = Api::all(s.client.clone());
    let verdicts = ["pass", "fail", "hang"];
    let mut hosts: Vec<Host> = Vec::new();
    let mut agents: Vec<Agent> = Vec::new();
    for (node, verdict) in s.nodes.iter().zip(verdicts) {
        let mut host = Host::new(node, 8).expect("host");
        host.kubelet(&s.client).expect("the kubelet's PodResources");
        host.device_plugin(&s.client)
            .await
            .expect("the device plugin");
        host.system_bus().await.expect("the system bus");
        let dcgmi = dcgmi_for(&host.state_dir().with_file_name("dcgmi"), verdict);
        let dcgmi = dcgmi.display().to_string();
        let agent = host
            .start_agent(&format!("{node}-agent"), &["--dcgmi", &dcgmi])
            .await
            .expect("agent");
        hosts.push(host);
        agents.push(agent);
    }
    for node in &s.nodes {
        until(nodes.clone(), node, WAIT, |n| {
            n.annotations()
                .get(GPU_REPORT_ANNOTATION)
                .and_then(|v| GpuReport::parse(v).ok())
                .is_some_and(|r| r.unreadable.is_none() && r.gpus.len() == 8)
        })
        .await
        .expect("the agent's report");
    }
    s.start_operator().await.expect("operator");
    for host in &hosts {
        host.incident_fault(7).expect("GPU 7's Xids 119 and 154");
    }

    // Pass: back in service, the diagnostic's verdict on GPU 7 kept.
    let pass = s.nodes[0].clone();
    let status = s.wait_recovered(&pass).await.expect("back to Healthy");
    let incident = status.history.first().expect("the incident");
    let tried: Vec<_> = incident
        .attempts
        .iter()
        .map(|a| (a.action, a.outcome))
        .collect();
    assert_eq!(
        tried,
        [
            (AttemptAction::GpuReset, AttemptOutcome::Succeeded),
            (AttemptAction::Diagnostics, AttemptOutcome::Succeeded),
        ]
    );
    let result = incident.attempts[1]
        .diagnostics
        .clone()
        .expect("each test's verdict");
    assert_eq!(result.level, DiagnosticsLevel::Quick);
    assert_eq!(result.verdict, DiagnosticsVerdict::Pass);
    assert_eq!(result.dcgm_version.as_deref(), Some("4.2.3"));
    assert!(
        result.tests.iter().any(|t| t.name == "software"
            && t.gpu == Some(uuid(7))
            && t.verdict == TestVerdict::Pass),
        "{result:?}"
    );
    assert!(
        result
            .tests
            .iter()
            .all(|t| t.gpu.is_none() || t.gpu == Some(uuid(7))),
        "only the reset GPU is diagnosed: {result:?}"
    );
    let n = nodes.get(&pass).await.expect("node");
    assert!(!is_cordoned(&n), "uncordoned after the pass");

    // Fail, and a hang cut off at the time budget: the next rung, the node
    // never back in service meanwhile.
    for (node, outcome, said) in [
        (&s.nodes[1], AttemptOutcome::Failed, "software on GPU-"),
        (&s.nodes[2], AttemptOutcome::TimedOut, "killed"),
    ] {
        let status = s
            .wait_status(node, "the next rung", |st| {
                st.action
                    .as_ref()
                    .is_some_and(|a| a.type_ == RecoveryAction::NodeReboot)
            })
            .await
            .expect("the next rung");
        let incident = status.history.first().expect("the incident");
        assert_eq!(incident.outcome, None, "{node}: still open");
        let diagnosed = incident
            .attempts
            .iter()
            .find(|a| a.action == AttemptAction::Diagnostics)
            .expect("the diagnostic on the record");
        assert_eq!(diagnosed.outcome, outcome, "{node}: {diagnosed:?}");
        let message = diagnosed.message.clone().unwrap_or_default();
        assert!(message.contains(said), "{node}: {message:?}");
        let n = nodes.get(node).await.expect("node");
        assert!(is_cordoned(&n), "{node} stays cordoned");
        assert_ne!(status.phase, Phase::Healthy);
    }
    // The two nodes left mid-incident would count against the cluster's
    // disruption bound in the tests sharing this cluster.
    drop(agents);
    s.operator.take();
    for node in &s.nodes {
        remove_node(&s.client, node).await;
    }
}
