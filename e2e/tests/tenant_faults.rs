//! A tenant's faults are the tenant's, against the real API server: one
//! pod faulting its GPU again and again gets a finding and a Warning Event
//! on the pod, and nothing is done to the GPU or counted against the node;
//! the same faults from a second workload reset the GPU, and the incident
//! says what opened it.

use gpuhealth_api::{
    node_health::Phase,
    vocabulary::{FindingKind, FindingSubject, PodKey, Reason},
};
use gpuhealth_e2e::{reports, scenario::Scenario};

#[tokio::test]
async fn one_pods_faults_are_its_own_and_two_workloads_faults_reset_the_gpu() {
    let mut s = Scenario::new("tenant-faults", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    s.start().await.expect("started");
    let node = s.nodes[0].clone();
    let pods = s.pods_on(&node).await.expect("pods");
    let on_gpu_7 = pods[7].clone();
    let mut report = reports::healthy(&s.namespace, &pods);

    // The pod on GPU 7 faults it three times.
    for _ in 0..3 {
        reports::app_fault(&mut report, 7, &s.namespace, &on_gpu_7);
    }
    s.write_report(&node, report.clone()).await.expect("report");
    let pod = PodKey::new(&s.namespace, &on_gpu_7);
    let status = s
        .wait_status(&node, "the AppFaultLoop finding", |st| {
            st.findings.iter().any(|f| {
                f.type_ == FindingKind::AppFaultLoop
                    && f.subject == Some(FindingSubject::Pod(pod.clone()))
            })
        })
        .await
        .expect("a finding about the pod");
    s.wait_event(&on_gpu_7, FindingKind::AppFaultLoop.as_str())
        .await
        .expect("a Warning Event on the pod");
    assert_eq!(status.phase, Phase::Healthy, "nothing done to the GPU");
    assert!(
        status.history.is_empty(),
        "no incident: {:?}",
        status.history
    );
    let n = s.node(&node).await.expect("node");
    assert_ne!(
        n.spec.and_then(|s| s.unschedulable),
        Some(true),
        "not cordoned"
    );
    let annotations = n.metadata.annotations.unwrap_or_default();
    assert!(
        !annotations.contains_key("gpuhealth.io/reset-request"),
        "no reset: {annotations:?}"
    );

    // Then a fault of GPU 7 in another workload's hands: the GPU is reset.
    reports::app_fault(&mut report, 7, &s.namespace, "batch-job-0");
    s.write_report(&node, report).await.expect("report");
    let status = s
        .wait_status(&node, "reset for two workloads' faults", |st| {
            st.history.first().is_some_and(|i| {
                i.signals
                    .first()
                    .is_some_and(|sig| sig.reason == Reason::RepeatedAppXids)
            })
        })
        .await
        .expect("an incident");
    let incident = &status.history[0];
    assert!(incident.opened_by_app_faults_alone(), "{incident:?}");
    assert!(
        incident.trigger.contains("from 2 workloads"),
        "{}",
        incident.trigger
    );
    assert_eq!(incident.gpus, [report_gpu_7(&s, &node).await]);
}

/// GPU 7's UUID in the node's record.
async fn report_gpu_7(s: &Scenario, node: &str) -> String {
    let status = s
        .wait_status(node, "the GPU table", |st| st.gpus.len() == 8)
        .await
        .expect("GPUs");
    status.gpus[7].uuid.clone()
}
