//! Training gangs on the real API server, with the real JobSet controller
//! (built from its own module, started beside the cluster with
//! `GPUHEALTH_CLUSTER_JOBS=1`): a 4-node JobSet, eight single-GPU ranks a
//! node, each rank's GPU a DRA claim the real scheduler allocates. One GPU
//! fails: every rank is told, then all leave together with the
//! `DisruptionTarget` condition, which the Jobs' `podFailurePolicy`
//! ignores, so the gang comes back without a restart counted; only the bad
//! GPU is fenced, and the gang runs again once it is back.

use std::{
    collections::BTreeSet,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use futures::StreamExt;
use gpuhealth_api::{
    gang::{DISRUPTION_PENDING_CONDITION, EVICT_AT_ANNOTATION, GangMode, JOBSET_NAME_LABEL},
    node_health::Phase,
    quarantine::RULE_NODE_LABEL,
};
use gpuhealth_e2e::{
    dra, reports,
    scenario::{Scenario, WAIT},
    sim::{SIM_GROUP_LABEL, is_cordoned},
    wait::{Background, applied, until_set},
};
use k8s_openapi::api::{
    batch::v1::Job,
    core::v1::{Node, Pod},
    resource::v1::ResourceClaim,
};
use kube::{
    Api, Client, ResourceExt,
    api::{DynamicObject, GroupVersionKind, ListParams, PostParams},
    discovery::ApiResource,
    runtime::watcher,
};
use serde_json::json;

const RANKS_PER_NODE: usize = 8;
const NODES: usize = 4;

fn jobsets(client: &Client, namespace: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("jobset.x-k8s.io", "v1alpha2", "JobSet");
    Api::namespaced_with(client.clone(), namespace, &ApiResource::from_gvk(&gvk))
}

/// A claim template for one GPU of the driver's class.
async fn gpu_claim_template(s: &Scenario) {
    let template: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "gpu", "namespace": s.namespace},
        "spec": {"spec": {"devices": {"requests": [{
            "name": "gpu",
            "exactly": {"deviceClassName": dra::CLASS, "count": 1},
        }]}}},
    }))
    .expect("a claim template");
    let gvk = GroupVersionKind::gvk("resource.k8s.io", "v1", "ResourceClaimTemplate");
    Api::<DynamicObject>::namespaced_with(
        s.client.clone(),
        &s.namespace,
        &ApiResource::from_gvk(&gvk),
    )
    .create(&PostParams::default(), &template)
    .await
    .expect("ResourceClaimTemplate gpu");
}

/// JobSet `train`: one Job a node, eight ranks each, every rank one GPU;
/// a rank's failure caused by a disruption is ignored (the podFailurePolicy
/// docs/concepts.md shows), any other fails its Job and restarts the set.
async fn training_jobset(s: &Scenario) {
    let jobset: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "train", "namespace": s.namespace},
        "spec": {
            "failurePolicy": {"maxRestarts": 3},
            "replicatedJobs": [{
                "name": "workers",
                "replicas": NODES,
                "template": {"spec": {
                    "parallelism": RANKS_PER_NODE,
                    "completions": RANKS_PER_NODE,
                    "completionMode": "Indexed",
                    // Per index: a rank's replacement waits its own
                    // backoff (10 s), not the Job's, which doubles with
                    // every rank that failed (six minutes for eight).
                    "backoffLimitPerIndex": 0,
                    "podFailurePolicy": {"rules": [{
                        "action": "Ignore",
                        "onPodConditions": [{"type": "DisruptionTarget"}],
                    }]},
                    "template": {
                        "metadata": {"annotations": {
                            // KWOK ends a Job's pods at once unless told not to.
                            "pod-complete.stage.kwok.x-k8s.io/delay": "24h",
                            "pod-complete.stage.kwok.x-k8s.io/jitter-delay": "24h",
                        }},
                        "spec": {
                            "restartPolicy": "Never",
                            "terminationGracePeriodSeconds": 1,
                            "nodeSelector": {SIM_GROUP_LABEL: s.group},
                            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu"}],
                            "containers": [{
                                "name": "trainer",
                                "image": "trainer:latest",
                                "resources": {"claims": [{"name": "gpu"}]},
                            }],
                        },
                    },
                }},
            }],
        },
    }))
    .expect("a JobSet");
    jobsets(&s.client, &s.namespace)
        .create(&PostParams::default(), &jobset)
        .await
        .expect("JobSet train (is the JobSet controller running? GPUHEALTH_CLUSTER_JOBS=1)");
}

fn running(p: &Pod) -> bool {
    p.metadata.deletion_timestamp.is_none()
        && p.status.as_ref().and_then(|s| s.phase.as_deref()) == Some("Running")
}

/// Waits until the gang's 32 ranks run; returns them by uid.
async fn ranks_running(s: &Scenario, what: &str) -> Vec<Pod> {
    let pods: Api<Pod> = Api::namespaced(s.client.clone(), &s.namespace);
    let config = watcher::Config::default().labels(&format!("{JOBSET_NAME_LABEL}=train"));
    let set = until_set(pods, config, what, WAIT * 2, |set| {
        set.values().filter(|p| running(p)).count() == NODES * RANKS_PER_NODE
    })
    .await
    .expect(what);
    set.into_values().filter(running).collect()
}

/// The GPU index rank `pod` was allocated, from its generated claim.
async fn gpu_of(client: &Client, pod: &Pod) -> u32 {
    let claim = pod
        .status
        .as_ref()
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.resource_claim_name.clone())
        .expect("a generated claim");
    let claim =
        Api::<ResourceClaim>::namespaced(client.clone(), &pod.namespace().unwrap_or_default())
            .get(&claim)
            .await
            .expect("the rank's claim");
    let device = dra::allocated_device(&claim).expect("allocated");
    device
        .trim_start_matches("gpu-")
        .parse()
        .expect("a device named by its GPU's index")
}

/// Whether the node is ever cordoned from now on, from a watch.
fn watch_cordon(client: &Client, node: &str) -> (Background, Arc<AtomicBool>) {
    let ever = Arc::new(AtomicBool::new(false));
    let seen = ever.clone();
    let config = watcher::Config::default().fields(&format!("metadata.name={node}"));
    let nodes: Api<Node> = Api::all(client.clone());
    let task = Background::spawn(async move {
        let mut stream = std::pin::pin!(applied(nodes, config));
        while let Some(n) = stream.next().await {
            if is_cordoned(&n) {
                seen.store(true, Ordering::SeqCst);
            }
        }
    });
    (task, ever)
}

fn told(p: &Pod) -> bool {
    p.annotations().contains_key(EVICT_AT_ANNOTATION)
        && p.status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| {
                cs.iter()
                    .any(|c| c.type_ == DISRUPTION_PENDING_CONDITION && c.status == "True")
            })
}

#[tokio::test]
async fn a_training_gang_leaves_whole_and_comes_back_without_a_restart_counted() {
    let mut spec = Scenario::quick_spec();
    spec.drain.gangs.notice = gpuhealth_api::Duration::from_secs(10);
    let mut s = Scenario::new_dra("gang", NODES, spec)
        .await
        .expect("scenario");
    gpu_claim_template(&s).await;
    training_jobset(&s).await;
    let before = ranks_running(&s, "32 ranks running").await;
    s.start().await.expect("operator and agent");

    // One rank's GPU fails on its node.
    let victim = &before[0];
    let node = victim
        .spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .expect("scheduled");
    let gpu = gpu_of(&s.client, victim).await;
    let (watch, ever_cordoned) = watch_cordon(&s.client, &node);
    let mut report = reports::healthy(&s.namespace, &[]);
    reports::xid_119_and_154(&mut report, gpu as usize);
    s.write_report(&node, report).await.expect("report");

    // Every rank, on every node, told first; none gone yet.
    let pods: Api<Pod> = Api::namespaced(s.client.clone(), &s.namespace);
    let uids: BTreeSet<String> = before.iter().filter_map(|p| p.uid()).collect();
    let config = watcher::Config::default().labels(&format!("{JOBSET_NAME_LABEL}=train"));
    let seen = until_set(
        pods.clone(),
        config.clone(),
        "every rank told",
        WAIT,
        |set| set.values().filter(|p| told(p)).count() == NODES * RANKS_PER_NODE,
    )
    .await
    .expect("every rank told");
    assert!(
        seen.values()
            .all(|p| p.metadata.deletion_timestamp.is_none()
                && p.uid().is_some_and(|u| uids.contains(&u))),
        "told before any leaves"
    );
    let status = s
        .wait_status(&node, "the gang on the record", |st| {
            st.history.first().is_some_and(|i| !i.gangs.is_empty())
        })
        .await
        .expect("recorded");
    let gang = &status.history[0].gangs[0];
    assert_eq!(
        gang.gang.to_string(),
        format!("JobSet {}/train", s.namespace)
    );
    assert_eq!(gang.mode, GangMode::Whole);
    assert_eq!(
        (gang.members, gang.nodes.len()),
        (32, NODES as u32 as usize)
    );
    s.wait_event(&node, "GangTold").await.expect("GangTold");
    let rules = dra::rules(&s.client).await.expect("rules");
    let fences = rules
        .list(&ListParams::default().labels(&format!("{RULE_NODE_LABEL}={node}")))
        .await
        .expect("rules");
    assert_eq!(fences.items.len(), 1, "the bad GPU alone is fenced");

    // Then all leave together, the reset follows, and the gang runs again.
    s.wait_event(&node, "GangEvicted")
        .await
        .expect("GangEvicted");
    let status = s.wait_recovered(&node).await.expect("recovered");
    assert!(status.history[0].gangs[0].evicted_at.is_some());
    let after = ranks_running(&s, "32 ranks running again").await;
    assert!(
        after
            .iter()
            .all(|p| p.uid().is_some_and(|u| !uids.contains(&u))),
        "every rank restarted, none left behind"
    );

    // Nothing counted against the job: no Job failed, the JobSet not restarted.
    let jobs = Api::<Job>::namespaced(s.client.clone(), &s.namespace)
        .list(&ListParams::default().labels(&format!("{JOBSET_NAME_LABEL}=train")))
        .await
        .expect("Jobs");
    assert_eq!(jobs.items.len(), NODES);
    for job in &jobs.items {
        let failed = job.status.as_ref().and_then(|s| s.failed).unwrap_or(0);
        assert_eq!(
            failed,
            0,
            "{}: a disruption counted as a failure",
            job.name_any()
        );
    }
    let jobset = jobsets(&s.client, &s.namespace)
        .get("train")
        .await
        .expect("JobSet");
    assert_eq!(
        jobset.data["status"]["restarts"].as_i64().unwrap_or(0),
        0,
        "the JobSet restarted: {:?}",
        jobset.data["status"]
    );

    // Only the GPU was fenced: the node never cordoned, its rule gone now.
    drop(watch);
    assert!(
        !ever_cordoned.load(Ordering::SeqCst),
        "the node was cordoned"
    );
    let left = rules
        .list(&ListParams::default().labels(&format!("{RULE_NODE_LABEL}={node}")))
        .await
        .expect("rules");
    assert!(left.items.is_empty(), "a fence outlived its incident");
    assert_eq!(status.phase, Phase::Healthy);
}
