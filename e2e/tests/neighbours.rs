//! gpuhealth among other actors and other times, on the real API server:
//! a provider's maintenance notice, a driver upgrade by the GPU Operator,
//! a GPU that keeps failing, and maintenance windows.

use std::time::{Duration, Instant};

use gpuhealth_api::{
    contract::{
        AnnotationValue, MAINTENANCE_ANNOTATION, MaintenanceNotice, NEEDS_REPLACEMENT_LABEL,
    },
    node_health::Phase,
    policy::{DrainScope, MaintenanceWindow},
    vocabulary::{IncidentOutcome, Reason},
};
use gpuhealth_e2e::{
    scenario::{Scenario, WAIT},
    sim::is_cordoned,
    wait::until,
};
use k8s_openapi::{
    api::{apps::v1::DaemonSet, core::v1::Node},
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    apimachinery::pkg::{apis::meta::v1::Time, util::intstr::IntOrString},
    jiff::{SignedDuration, Timestamp},
};
use kube::{
    Api, ResourceExt,
    api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams},
};
use serde_json::json;

async fn patch_node(s: &Scenario, node: &str, patch: serde_json::Value) {
    Api::<Node>::all(s.client.clone())
        .patch(node, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .expect("patch node");
}

#[tokio::test]
async fn a_maintenance_notice_drains_the_node_in_time_and_it_returns_after_the_reboot() {
    let mut spec = Scenario::quick_spec();
    spec.maintenance.lead_time = gpuhealth_api::Duration::from_mins(1);
    let mut s = Scenario::new("maintenance", 1, spec)
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    s.start().await.expect("operator");

    // The vendor's notice: maintenance in 2 minutes.
    // To the second, as Kubernetes keeps times.
    let deadline =
        Timestamp::from_second((Timestamp::now() + SignedDuration::from_mins(2)).as_second())
            .expect("deadline");
    let notice = MaintenanceNotice {
        deadline: Time(deadline),
        source: "cloud-provider".into(),
        reason: "hardware maintenance scheduled; authorise or we reboot it then".into(),
        reference: Some("evt-2026-06-02-0815".into()),
    };
    let written = Instant::now();
    patch_node(
        &s,
        &node,
        json!({"metadata": {"annotations": {MAINTENANCE_ANNOTATION: notice.to_annotation()}}}),
    )
    .await;

    let status = s
        .wait_status(&node, "drained and awaiting maintenance", |st| {
            st.phase == Phase::AwaitingMaintenance
        })
        .await
        .expect("awaiting maintenance");
    let waited = written.elapsed();
    eprintln!("notice -> drained and awaiting maintenance: {waited:?} (lead time 60s)");
    assert!(Timestamp::now() < deadline, "drained before the deadline");
    assert!(
        waited >= Duration::from_secs(55),
        "not before the lead time: {waited:?}"
    );
    assert!(is_cordoned(&s.node(&node).await.expect("node")));
    assert!(
        s.pods_on(&node).await.expect("pods").is_empty(),
        "every pod left"
    );
    assert_eq!(
        status.maintenance.as_ref().map(|m| &m.deadline),
        Some(&notice.deadline)
    );
    assert!(
        s.agent.requests().is_empty(),
        "no reset or reboot of gpuhealth's own"
    );

    // The provider reboots it: back to Healthy, uncordoned.
    s.rebooted_by_provider(&node).await.expect("reboot");
    let status = s.wait_recovered(&node).await.expect("back in service");
    assert_eq!(
        status.history[0].maintenance_deadline.as_ref(),
        Some(&notice.deadline)
    );
    assert!(!is_cordoned(&s.node(&node).await.expect("node")));
    assert!(s.agent.requests().is_empty());
}

#[tokio::test]
async fn a_node_in_a_driver_upgrade_is_left_alone_and_counts_against_max_concurrent() {
    let mut spec = Scenario::quick_spec();
    spec.max_concurrent = IntOrString::Int(1);
    spec.max_unhealthy = IntOrString::Int(2);
    let mut s = Scenario::new("upgrade", 2, spec).await.expect("scenario");
    let (upgrading, other) = (s.nodes[0].clone(), s.nodes[1].clone());
    patch_node(
        &s,
        &upgrading,
        json!({"metadata": {"labels": {"nvidia.com/gpu-driver-upgrade-state": "upgrade-required"}}}),
    )
    .await;
    s.start().await.expect("operator");

    // Both nodes get a bad GPU; the upgrading node is not touched, and it
    // takes the one disruption maxConcurrent allows.
    s.break_gpu(&upgrading, 7).await.expect("break");
    s.break_gpu(&other, 3).await.expect("break");
    let held = s
        .wait_status(&upgrading, "held for the upgrade", |st| {
            st.reason == Some(Reason::DisruptedByOther)
        })
        .await
        .expect("held");
    assert_eq!(held.phase, Phase::Suspect);
    assert_eq!(
        held.disrupted_by,
        ["gpu-operator: label nvidia.com/gpu-driver-upgrade-state=upgrade-required"]
    );
    let waiting = s
        .wait_status(&other, "waiting for the budget", |st| {
            st.reason == Some(Reason::WaitingForBudget)
        })
        .await
        .expect("waiting");
    assert!(
        waiting
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("1 disrupted by other tools"),
        "{:?}",
        waiting.message
    );
    for n in [&upgrading, &other] {
        assert!(
            !is_cordoned(&s.node(n).await.expect("node")),
            "{n} untouched"
        );
    }
    assert!(s.agent.requests().is_empty());

    // The upgrade finishes: both are remediated, one at a time.
    patch_node(
        &s,
        &upgrading,
        json!({"metadata": {"labels": {"nvidia.com/gpu-driver-upgrade-state": "upgrade-done"}}}),
    )
    .await;
    s.wait_recovered(&upgrading).await.expect("upgrading node");
    s.wait_recovered(&other).await.expect("other node");
    assert_eq!(s.agent.requests().len(), 2);
}

#[tokio::test]
async fn the_third_remediation_of_a_gpu_hands_the_node_over_for_replacement() {
    let mut spec = Scenario::quick_spec();
    spec.remediation_limits.per_gpu = 2;
    spec.remediation_limits.cooldown = gpuhealth_api::Duration::ZERO;
    let mut s = Scenario::new("repeat", 1, spec).await.expect("scenario");
    let node = s.nodes[0].clone();
    s.start().await.expect("operator");
    for round in 1..=2 {
        s.break_gpu(&node, 7).await.expect("break");
        let status = s
            .wait_status(&node, "recovered", |st| {
                st.phase == Phase::Healthy
                    && st.history.len() == round
                    && st.history[0].outcome == Some(IncidentOutcome::Recovered)
            })
            .await
            .expect("recovered");
        assert_eq!(status.history.len(), round);
    }
    s.break_gpu(&node, 7).await.expect("break");
    let status = s
        .wait_status(&node, "handed over", |st| st.phase == Phase::Failed)
        .await
        .expect("failed");
    assert_eq!(status.reason, Some(Reason::RepeatedFailures));
    assert!(
        status
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("remediated 2 times"),
        "{:?}",
        status.message
    );
    let n = until(Api::<Node>::all(s.client.clone()), &node, WAIT, |n| {
        n.labels().get(NEEDS_REPLACEMENT_LABEL).map(String::as_str) == Some("true")
    })
    .await
    .expect("labelled");
    assert!(is_cordoned(&n), "cordoned for the hand-over");
    assert_eq!(
        s.agent.requests().len(),
        2,
        "no third reset: {:?}",
        s.agent.requests()
    );
}

/// A window that opens at least an hour from now: closed for the length
/// of the test. (From the next hour on, a test started at 13:59:59 met
/// its window open at 14:00.)
fn closed_window() -> MaintenanceWindow {
    let hour = |d: i64| {
        (Timestamp::now() + SignedDuration::from_hours(d))
            .strftime("%H:00")
            .to_string()
    };
    MaintenanceWindow {
        days: Vec::new(),
        start: hour(2),
        end: hour(3),
        time_zone: "UTC".into(),
    }
}

#[tokio::test]
async fn outside_a_window_a_gpu_pods_drain_waits_and_an_affected_pods_reset_proceeds() {
    let mut spec = Scenario::quick_spec();
    spec.drain.scope = DrainScope::GpuPods;
    spec.maintenance_windows = vec![closed_window()];
    let mut s = Scenario::new("window-wide", 1, spec)
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    s.start().await.expect("operator");
    let before = s.pods_on(&node).await.expect("pods");
    s.break_gpu(&node, 7).await.expect("break");
    let status = s
        .wait_status(&node, "held for the window", |st| {
            st.reason == Some(Reason::OutsideMaintenanceWindow)
        })
        .await
        .expect("held");
    assert_eq!(status.phase, Phase::Quarantined);
    assert!(
        status
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("next maintenance window opens"),
        "{:?}",
        status.message
    );
    assert_eq!(
        s.pods_on(&node).await.expect("pods"),
        before,
        "no pod evicted"
    );
    assert!(s.agent.requests().is_empty());
    drop(s);

    // The same window, scoped to the broken GPU's own pods: at once.
    let mut spec = Scenario::quick_spec();
    spec.maintenance_windows = vec![closed_window()];
    let mut s = Scenario::new("window-own", 1, spec)
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    s.start().await.expect("operator");
    s.break_gpu(&node, 7).await.expect("break");
    s.wait_recovered(&node).await.expect("reset at once");
    assert_eq!(s.agent.requests().len(), 1);
}

/// Medik8s' NodeMaintenance kind, as its operator installs it (schema
/// reduced to what gpuhealth reads).
async fn install_node_maintenance_kind(s: &Scenario) {
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": "nodemaintenances.nodemaintenance.medik8s.io"},
        "spec": {
            "group": "nodemaintenance.medik8s.io",
            "scope": "Cluster",
            "names": {"kind": "NodeMaintenance", "plural": "nodemaintenances", "singular": "nodemaintenance"},
            "versions": [{
                "name": "v1beta1", "served": true, "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}},
            }],
        },
    }))
    .expect("crd");
    let api: Api<CustomResourceDefinition> = Api::all(s.client.clone());
    api.patch(
        "nodemaintenances.nodemaintenance.medik8s.io",
        &PatchParams::apply("gpuhealth-e2e").force(),
        &Patch::Apply(&crd),
    )
    .await
    .expect("install the NodeMaintenance kind");
    until(
        api,
        "nodemaintenances.nodemaintenance.medik8s.io",
        WAIT,
        |c| {
            c.status
                .as_ref()
                .and_then(|s| s.conditions.as_ref())
                .is_some_and(|cs| {
                    cs.iter()
                        .any(|c| c.type_ == "Established" && c.status == "True")
                })
        },
    )
    .await
    .expect("established");
}

#[tokio::test]
async fn kureds_lock_and_a_medik8s_node_maintenance_hold_the_nodes_they_name() {
    let mut spec = Scenario::quick_spec();
    spec.max_unhealthy = IntOrString::Int(2);
    let mut s = Scenario::new("locks", 2, spec).await.expect("scenario");
    let (maintained, rebooting) = (s.nodes[0].clone(), s.nodes[1].clone());
    install_node_maintenance_kind(&s).await;
    let resource = ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("nodemaintenance.medik8s.io", "v1beta1", "NodeMaintenance"),
        "nodemaintenances",
    );
    let maintenances: Api<DynamicObject> = Api::all_with(s.client.clone(), &resource);
    let maintenance = format!("{}-maintenance", s.group);
    let mut object = DynamicObject::new(&maintenance, &resource);
    object.data = json!({"spec": {"nodeName": maintained, "reason": "NIC replacement"}});
    maintenances
        .create(&PostParams::default(), &object)
        .await
        .expect("NodeMaintenance");
    // kured holds its lock for the other node, on its DaemonSet.
    let daemonsets: Api<DaemonSet> = Api::namespaced(s.client.clone(), "kube-system");
    let lock = json!({"nodeID": rebooting, "metadata": {"unschedulable": false}, "created": Timestamp::now().to_string(), "TTL": 0});
    let kured: DaemonSet = serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": "kured", "namespace": "kube-system",
                     "annotations": {"weave.works/kured-node-lock": lock.to_string()}},
        "spec": {
            "selector": {"matchLabels": {"name": "kured"}},
            "template": {
                "metadata": {"labels": {"name": "kured"}},
                "spec": {"nodeSelector": {"gpuhealth.io/no-such-node": "x"},
                         "containers": [{"name": "kured", "image": "ghcr.io/kubereboot/kured:1.17.1"}]},
            },
        },
    }))
    .expect("kured");
    let _ = daemonsets.delete("kured", &Default::default()).await;
    daemonsets
        .create(&PostParams::default(), &kured)
        .await
        .expect("kured's DaemonSet");
    s.start().await.expect("operator");

    s.break_gpu(&maintained, 7).await.expect("break");
    s.break_gpu(&rebooting, 7).await.expect("break");
    for (node, by) in [
        (
            &maintained,
            format!("medik8s: NodeMaintenance {maintenance}"),
        ),
        (
            &rebooting,
            "kured: reboot lock weave.works/kured-node-lock on kube-system/kured".to_owned(),
        ),
    ] {
        let held = s
            .wait_status(node, "held for the other tool", |st| {
                st.reason == Some(Reason::DisruptedByOther)
            })
            .await
            .expect("held");
        assert_eq!(held.disrupted_by, [by], "{node}");
        assert!(
            !is_cordoned(&s.node(node).await.expect("node")),
            "{node} untouched"
        );
    }
    assert!(s.agent.requests().is_empty());

    // Both tools finish: gpuhealth takes over, one node at a time.
    maintenances
        .delete(&maintenance, &Default::default())
        .await
        .expect("end the maintenance");
    daemonsets
        .delete("kured", &Default::default())
        .await
        .expect("release kured's lock");
    s.wait_recovered(&maintained)
        .await
        .expect("maintained node");
    s.wait_recovered(&rebooting).await.expect("rebooted node");
}
