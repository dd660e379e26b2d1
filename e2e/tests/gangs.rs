//! Training gangs on the real API server, with the real JobSet controller
//! (built from its own module, started beside the cluster with
//! `GPUHEALTH_CLUSTER_JOBS=1`): a 4-node JobSet, eight single-GPU ranks a
//! node, each rank's GPU a DRA claim the real scheduler allocates. One GPU
//! fails: every rank is told, then all leave together with the
//! `DisruptionTarget` condition, which the Jobs' `podFailurePolicy`
//! ignores, so the gang comes back without a restart counted; only the bad
//! GPU is fenced, and the gang runs again once it is back. Under `Member`
//! only the rank on the bad GPU moves; a LeaderWorkerSet group (the real
//! LWS controller) leaves whole while the other group serves on.

use std::{
    collections::BTreeSet,
    sync::{Arc, atomic::Ordering},
};

use futures::StreamExt;
use gpuhealth_api::{
    contract::RemappedRows,
    gang::{
        DISRUPTION_PENDING_CONDITION, EVICT_AT_ANNOTATION, GangMode, JOBSET_NAME_LABEL,
        LWS_GROUP_INDEX_LABEL, LWS_NAME_LABEL,
    },
    node_health::Phase,
    quarantine::RULE_NODE_LABEL,
};
use gpuhealth_e2e::{
    agent::Request,
    dra, reports,
    scenario::{Scenario, WAIT},
    sim::{SIM_GROUP_LABEL, watch_cordon},
    wait::{Background, applied, until_set},
};
use k8s_openapi::api::{batch::v1::Job, core::v1::Pod, resource::v1::ResourceClaim};
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

/// Waits until `count` pods matching `selector` run; returns them.
async fn running_pods(s: &Scenario, selector: &str, count: usize, what: &str) -> Vec<Pod> {
    let pods: Api<Pod> = Api::namespaced(s.client.clone(), &s.namespace);
    let config = watcher::Config::default().labels(selector);
    let set = until_set(pods, config, what, WAIT * 2, |set| {
        set.values().filter(|p| running(p)).count() == count
    })
    .await
    .expect(what);
    set.into_values().filter(running).collect()
}

/// Waits until the gang's 32 ranks run; returns them.
async fn ranks_running(s: &Scenario, what: &str) -> Vec<Pod> {
    let selector = format!("{JOBSET_NAME_LABEL}=train");
    running_pods(s, &selector, NODES * RANKS_PER_NODE, what).await
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

/// The uids of every rank of `train` seen from now on.
fn watch_ranks(s: &Scenario) -> (Background, Arc<std::sync::Mutex<BTreeSet<String>>>) {
    let seen = Arc::new(std::sync::Mutex::new(BTreeSet::new()));
    let into = seen.clone();
    let pods: Api<Pod> = Api::namespaced(s.client.clone(), &s.namespace);
    let config = watcher::Config::default().labels(&format!("{JOBSET_NAME_LABEL}=train"));
    let task = Background::spawn(async move {
        let mut stream = std::pin::pin!(applied(pods, config));
        while let Some(p) = stream.next().await {
            if let (Some(uid), Ok(mut seen)) = (p.uid(), into.lock()) {
                seen.insert(uid);
            }
        }
    });
    (task, seen)
}

fn node_of(pod: &Pod) -> String {
    pod.spec
        .as_ref()
        .and_then(|s| s.node_name.clone())
        .expect("scheduled")
}

/// The GPU `pod` holds fails (Xid 119) on its node.
async fn break_gpu_of(s: &Scenario, pod: &Pod) {
    let gpu = gpu_of(&s.client, pod).await;
    let mut report = reports::healthy(&s.namespace, &[]);
    reports::xid_119_and_154(&mut report, gpu as usize);
    s.write_report(&node_of(pod), report).await.expect("report");
}

fn uids(pods: &[Pod]) -> BTreeSet<String> {
    pods.iter().filter_map(|p| p.uid()).collect()
}

/// Every Job of `train` is there and none counts a failure: a disruption
/// cost the job nothing.
async fn assert_no_job_failed(s: &Scenario) {
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

    // Every rank ever seen, to count the gang's restarts.
    let (_ranks, seen_ranks) = watch_ranks(&s);
    // One rank's GPU fails on its node; another node of the gang has a row
    // remap pending until its GPU's next reset.
    let node = node_of(&before[0]);
    let other = before
        .iter()
        .find(|p| node_of(p) != node)
        .expect("a rank on another node");
    let (other_node, other_gpu) = (node_of(other), gpu_of(&s.client, other).await);
    let mut pending = reports::healthy(&s.namespace, &[]);
    pending.gpus[other_gpu as usize].remapped_rows = Some(RemappedRows {
        pending: true,
        failure: false,
    });
    let other_uuid = pending.gpus[other_gpu as usize].uuid.clone();
    s.write_report(&other_node, pending).await.expect("report");
    let (watch, ever_cordoned) = watch_cordon(&s.client, &node);
    break_gpu_of(&s, &before[0]).await;

    // Every rank, on every node, told first; none gone yet.
    let pods: Api<Pod> = Api::namespaced(s.client.clone(), &s.namespace);
    let uids = uids(&before);
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
    assert_no_job_failed(&s).await;
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

    // The other node's pending repair was done in the same window, its GPU
    // alone, and cost the gang no second restart.
    let bundled = s
        .wait_recovered(&other_node)
        .await
        .expect("the other node repaired");
    let repair = &bundled.history[0];
    assert!(
        repair.trigger.contains(&status.history[0].id) && repair.trigger.contains("JobSet"),
        "the repair names the gang's incident: {}",
        repair.trigger
    );
    assert!(repair.started_at.0 <= status.history[0].ended_at.as_ref().expect("ended").0);
    let resets: Vec<Vec<String>> = s
        .agent
        .requests()
        .into_iter()
        .filter_map(|r| match r {
            Request::Reset { id, gpus } if id.starts_with(&repair.id) => Some(gpus),
            _ => None,
        })
        .collect();
    assert_eq!(resets, vec![vec![other_uuid]], "that GPU alone reset");
    let _ = ranks_running(&s, "32 ranks running after both").await;
    let ever = seen_ranks.lock().map(|s| s.len()).unwrap_or_default();
    assert_eq!(
        ever, 64,
        "the gang restarted once: its 32 ranks, then 32 new ones"
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

#[tokio::test]
async fn under_member_only_the_rank_on_the_bad_gpu_moves() {
    let mut spec = Scenario::quick_spec();
    spec.drain.gangs.mode = GangMode::Member;
    let mut s = Scenario::new_dra("gang-member", NODES, spec)
        .await
        .expect("scenario");
    gpu_claim_template(&s).await;
    training_jobset(&s).await;
    let before = ranks_running(&s, "32 ranks running").await;
    s.start().await.expect("operator and agent");
    let victim = before[0].clone();
    let node = node_of(&victim);
    break_gpu_of(&s, &victim).await;

    let status = s.wait_recovered(&node).await.expect("recovered");
    let gang = &status.history[0].gangs[0];
    assert_eq!(
        (gang.mode, gang.evict_at.is_none()),
        (GangMode::Member, true)
    );
    let after = ranks_running(&s, "32 ranks running again").await;
    let (kept, new): (Vec<&Pod>, Vec<&Pod>) = after
        .iter()
        .partition(|p| p.uid().is_some_and(|u| uids(&before).contains(&u)));
    assert_eq!(
        (kept.len(), new.len()),
        (31, 1),
        "only the rank on the bad GPU moved"
    );
    assert!(
        after.iter().all(|p| !told(p)),
        "no rank is told under Member"
    );
    assert_no_job_failed(&s).await;
}

/// LeaderWorkerSet `serve`: two groups of a leader and three workers, each
/// pod one GPU; a group is recreated whole by LWS when one of its pods is.
async fn serving_groups(s: &Scenario) {
    let gvk = GroupVersionKind::gvk("leaderworkerset.x-k8s.io", "v1", "LeaderWorkerSet");
    let lws: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "serve", "namespace": s.namespace},
        "spec": {
            "replicas": 2,
            "leaderWorkerTemplate": {
                "size": 4,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "workerTemplate": {"spec": {
                    "terminationGracePeriodSeconds": 1,
                    "nodeSelector": {SIM_GROUP_LABEL: s.group},
                    "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu"}],
                    "containers": [{
                        "name": "server",
                        "image": "vllm/vllm-openai:latest",
                        "resources": {"claims": [{"name": "gpu"}]},
                    }],
                }},
            },
        },
    }))
    .expect("a LeaderWorkerSet");
    Api::<DynamicObject>::namespaced_with(
        s.client.clone(),
        &s.namespace,
        &ApiResource::from_gvk(&gvk),
    )
    .create(&PostParams::default(), &lws)
    .await
    .expect("LeaderWorkerSet serve (is the LWS controller running? GPUHEALTH_CLUSTER_JOBS=1)");
}

#[tokio::test]
async fn a_leader_worker_group_leaves_whole_and_the_other_group_serves_on() {
    let mut spec = Scenario::quick_spec();
    spec.drain.gangs.notice = gpuhealth_api::Duration::from_secs(3);
    let mut s = Scenario::new_dra("gang-lws", 2, spec)
        .await
        .expect("scenario");
    gpu_claim_template(&s).await;
    serving_groups(&s).await;
    let group = |i: u32| format!("{LWS_NAME_LABEL}=serve,{LWS_GROUP_INDEX_LABEL}={i}");
    let zero = running_pods(&s, &group(0), 4, "group 0 serving").await;
    let one = running_pods(&s, &group(1), 4, "group 1 serving").await;
    s.start().await.expect("operator and agent");

    // A worker's GPU in group 0 fails.
    let worker = zero
        .iter()
        .find(|p| {
            p.labels()
                .get("leaderworkerset.sigs.k8s.io/worker-index")
                .map(String::as_str)
                != Some("0")
        })
        .expect("a worker");
    let node = node_of(worker);
    break_gpu_of(&s, worker).await;
    s.wait_event(&node, "GangEvicted")
        .await
        .expect("GangEvicted");
    let status = s.wait_recovered(&node).await.expect("recovered");
    let gang = &status.history[0].gangs[0];
    assert_eq!(
        gang.gang.to_string(),
        format!("LeaderWorkerSet {}/serve-0", s.namespace)
    );
    assert_eq!(gang.members, 4);

    let zero_after = running_pods(&s, &group(0), 4, "group 0 serving again").await;
    assert!(
        uids(&zero_after).is_disjoint(&uids(&zero)),
        "group 0 came back whole, none of its pods left behind"
    );
    let one_after = running_pods(&s, &group(1), 4, "group 1 serving").await;
    assert_eq!(uids(&one_after), uids(&one), "group 1 untouched");
}
