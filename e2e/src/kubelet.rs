//! A stand-in for the kubelet where KWOK's stages cannot say what a test
//! needs: how long a pod takes to start, and a startup probe killing it.
//! Pods whose template carries [`TEST_KUBELET`] are not made Ready by
//! KWOK for a day (its `pod-ready` stage's delay, and the jitter that would
//! otherwise cut it short); this writes their status, and the Events the
//! kubelet would, as the test says for their `app` label.

use std::{
    collections::{BTreeMap, HashSet},
    sync::{Arc, Mutex},
    time::Duration,
};

use futures::StreamExt;
use k8s_openapi::{
    api::{
        apps::v1::Deployment,
        core::v1::{Event, EventSource, ObjectReference, Pod},
    },
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
    jiff::Timestamp,
};
use kube::{
    Api, Client, ResourceExt,
    api::{Patch, PatchParams, PostParams},
    runtime::watcher,
};
use serde_json::json;

use crate::{
    Result,
    sim::with_pod_annotation,
    wait::{Background, applied},
};

/// The pod annotations that take a pod's start away from KWOK.
pub const TEST_KUBELET: [(&str, &str); 2] = [
    ("pod-ready.stage.kwok.x-k8s.io/delay", "24h"),
    ("pod-ready.stage.kwok.x-k8s.io/jitter-delay", "24h"),
];

/// Pods of `deployment` are started by the test's kubelet, not by KWOK.
pub fn with_test_kubelet(deployment: &mut Deployment) {
    for pair in TEST_KUBELET {
        with_pod_annotation(deployment, pair);
    }
}

/// How a pod of an `app` starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Start {
    /// Ready this long after its container started.
    Ready { cold_start: Duration },
    /// Killed by its startup probe this long into each start, `restarts`
    /// times so far; now in its next start, not Ready.
    StartupProbeLoop {
        killed_after: Duration,
        restarts: i32,
    },
}

/// The behaviour per `app` label; change it while the kubelet runs.
#[derive(Clone, Default)]
pub struct Kubelet {
    starts: Arc<Mutex<BTreeMap<String, Start>>>,
}

impl Kubelet {
    pub fn set(&self, app: &str, start: Start) {
        if let Ok(mut s) = self.starts.lock() {
            s.insert(app.into(), start);
        }
    }

    fn start_of(&self, pod: &Pod) -> Option<Start> {
        let app = pod.labels().get("app")?;
        self.starts.lock().ok()?.get(app).copied()
    }

    /// Starts each pod of `namespace` that carries [`TEST_KUBELET`] once
    /// KWOK has given it an IP, as its app's [`Start`] says at that moment.
    pub fn spawn(&self, client: Client, namespace: &str) -> Background {
        let kubelet = self.clone();
        let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
        Background::spawn(async move {
            let mut started: HashSet<String> = HashSet::new();
            let mut stream = std::pin::pin!(applied(pods.clone(), watcher::Config::default()));
            while let Some(pod) = stream.next().await {
                let uid = pod.uid().unwrap_or_default();
                let ours = TEST_KUBELET
                    .iter()
                    .all(|(k, v)| pod.annotations().get(*k).map(String::as_str) == Some(*v));
                let has_ip = pod
                    .status
                    .as_ref()
                    .and_then(|s| s.pod_ip.as_ref())
                    .is_some();
                if !ours || !has_ip || pod.metadata.deletion_timestamp.is_some() {
                    continue;
                }
                let Some(start) = kubelet.start_of(&pod) else {
                    continue;
                };
                if started.contains(&uid) {
                    continue;
                }
                match write(&client, &pods, &pod, start).await {
                    Ok(()) => {
                        started.insert(uid);
                    }
                    Err(e) => eprintln!("test kubelet: {}: {e}", pod.name_any()),
                }
            }
        })
    }
}

fn ago(d: Duration) -> Time {
    Time(
        Timestamp::now()
            .saturating_sub(d)
            .unwrap_or(Timestamp::now()),
    )
}

fn condition(type_: &str, status: bool, at: &Time) -> serde_json::Value {
    json!({"type": type_, "status": if status { "True" } else { "False" }, "lastTransitionTime": at})
}

async fn write(client: &Client, pods: &Api<Pod>, pod: &Pod, start: Start) -> Result<()> {
    let container = pod
        .spec
        .as_ref()
        .and_then(|s| s.containers.first())
        .map(|c| (c.name.clone(), c.image.clone().unwrap_or_default()))
        .unwrap_or_default();
    let now = Time(Timestamp::now());
    let status = match start {
        Start::Ready { cold_start } => json!({
            "phase": "Running",
            "conditions": [
                condition("Initialized", true, &now),
                condition("ContainersReady", true, &now),
                condition("Ready", true, &now),
            ],
            "containerStatuses": [{
                "name": container.0, "image": container.1, "imageID": "",
                "ready": true, "started": true, "restartCount": 0,
                "state": {"running": {"startedAt": ago(cold_start)}},
            }],
        }),
        Start::StartupProbeLoop {
            killed_after,
            restarts,
        } => {
            // The last run ended a few seconds ago; the next one has begun.
            let killed = Duration::from_secs(5);
            let pod_ip = pod
                .status
                .as_ref()
                .and_then(|s| s.pod_ip.clone())
                .unwrap_or_default();
            let (refused, killing) = kubelet_events(pod, &container.0, &pod_ip, &ago(killed));
            let events: Api<Event> =
                Api::namespaced(client.clone(), &pod.namespace().unwrap_or_default());
            for e in [refused, killing] {
                events.create(&PostParams::default(), &e).await?;
            }
            json!({
                "phase": "Running",
                "conditions": [
                    condition("Initialized", true, &now),
                    condition("ContainersReady", false, &now),
                    condition("Ready", false, &now),
                ],
                "containerStatuses": [{
                    "name": container.0, "image": container.1, "imageID": "",
                    "ready": false, "started": false, "restartCount": restarts,
                    "state": {"running": {"startedAt": ago(Duration::from_secs(4))}},
                    "lastState": {"terminated": {
                        "exitCode": 137, "reason": "Error",
                        "startedAt": ago(killed + killed_after),
                        "finishedAt": ago(killed),
                    }},
                }],
            })
        }
    };
    pods.patch_status(
        &pod.name_any(),
        &PatchParams::default(),
        &Patch::Merge(json!({"status": status})),
    )
    .await?;
    Ok(())
}

/// What the kubelet logs when a startup probe kills a server that never
/// listened: the refused probe, then the kill.
fn kubelet_events(pod: &Pod, container: &str, pod_ip: &str, at: &Time) -> (Event, Event) {
    let event = |suffix: &str, type_: &str, reason: &str, message: String| Event {
        metadata: ObjectMeta {
            name: Some(format!("{}.{suffix}", pod.name_any())),
            namespace: pod.namespace(),
            ..Default::default()
        },
        involved_object: ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(pod.name_any()),
            namespace: pod.namespace(),
            uid: pod.uid(),
            field_path: Some(format!("spec.containers{{{container}}}")),
            ..Default::default()
        },
        type_: Some(type_.into()),
        reason: Some(reason.into()),
        message: Some(message),
        source: Some(EventSource {
            component: Some("kubelet".into()),
            host: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
        }),
        reporting_component: Some("kubelet".into()),
        first_timestamp: Some(at.clone()),
        last_timestamp: Some(at.clone()),
        count: Some(1),
        ..Default::default()
    };
    (
        event(
            "unhealthy",
            "Warning",
            "Unhealthy",
            format!(
                "Startup probe failed: Get \"http://{pod_ip}:8000/health\": dial tcp {pod_ip}:8000: connect: connection refused"
            ),
        ),
        event(
            "killing",
            "Normal",
            "Killing",
            format!("Container {container} failed startup probe, will be restarted"),
        ),
    )
}
