//! Watching the fleet from outside: when each node was seen cordoned, and
//! the floor, the least any controller on this API server could do: cordon
//! a node as soon as its report shows a bad GPU.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Instant,
};

use futures::StreamExt;
use gpuhealth_api::contract::{AnnotationValue, GPU_REPORT_ANNOTATION, GpuReport};
use gpuhealth_e2e::{
    sim::{SIM_GROUP_LABEL, is_cordoned},
    wait::{Background, applied},
};
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api, Client, ResourceExt,
    api::{Patch, PatchParams},
    runtime::watcher,
};
use serde_json::json;

use crate::fleet::GROUP;

fn fleet_nodes(client: &Client) -> (Api<Node>, watcher::Config) {
    let config = watcher::Config::default().labels(&format!("{SIM_GROUP_LABEL}={GROUP}"));
    (Api::all(client.clone()), config)
}

fn simulated_nodes(client: &Client) -> (Api<Node>, watcher::Config) {
    let config = watcher::Config::default().labels(SIM_GROUP_LABEL);
    (Api::all(client.clone()), config)
}

#[derive(Default)]
struct Seen {
    /// When each node turned from schedulable to cordoned.
    cordoned: HashMap<String, Vec<Instant>>,
    /// When each node's report turned from all healthy to showing a bad GPU.
    sick: HashMap<String, Vec<Instant>>,
    /// When each node's [`CONDITION`] turned `False`.
    condition_false: HashMap<String, Vec<Instant>>,
    /// When each node's report turned from naming no Xid to naming one.
    xid: HashMap<String, Vec<Instant>>,
}

/// What the watch keeps of a node between two events.
#[derive(Clone, Copy, Default)]
struct Looks {
    cordoned: bool,
    sick: bool,
    condition_false: bool,
    xid: bool,
}

impl Looks {
    fn of(node: &Node) -> Looks {
        let report = report(node);
        Looks {
            cordoned: is_cordoned(node),
            sick: report.as_ref().is_some_and(shows_a_bad_gpu),
            condition_false: condition_false(node),
            xid: report.as_ref().is_some_and(names_an_xid),
        }
    }
}

/// What one watch on the simulated nodes saw, and when: both ends of a
/// time to quarantine come from the same stream, so neither depends on
/// when the task that wrote the fault was next scheduled.
#[derive(Clone, Default)]
pub struct Cordons(Arc<Mutex<Seen>>);

fn condition_false(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c.type_ == CONDITION && c.status == "False")
        })
}

/// The node's GPU report, if it has a valid one.
pub fn report(node: &Node) -> Option<GpuReport> {
    GpuReport::parse(node.annotations().get(GPU_REPORT_ANNOTATION)?).ok()
}

fn shows_a_bad_gpu(report: &GpuReport) -> bool {
    report.bad_gpus().next().is_some()
}

/// Whether a report names an Xid on any GPU: the real agent's NVML backend
/// reports a GPU's state as it reads it and leaves its Xids to the
/// operator to judge, so an Xid alone leaves every GPU `Healthy`.
pub fn names_an_xid(report: &GpuReport) -> bool {
    report.gpus.iter().any(|g| !g.xids.is_empty())
}

impl Cordons {
    /// Records until the handle is dropped.
    pub fn watch(&self, client: &Client) -> Background {
        let (nodes, config) = simulated_nodes(client);
        let seen = self.0.clone();
        Background::spawn(async move {
            let mut last: HashMap<String, Looks> = HashMap::new();
            let mut stream = std::pin::pin!(applied(nodes, config));
            while let Some(node) = stream.next().await {
                let now = Instant::now();
                let is = Looks::of(&node);
                let was = last.insert(node.name_any(), is).unwrap_or_default();
                let mut guard = seen.lock().unwrap_or_else(|e| e.into_inner());
                let seen = &mut *guard;
                let turned = [
                    (is.cordoned && !was.cordoned, &mut seen.cordoned),
                    (is.sick && !was.sick, &mut seen.sick),
                    (
                        is.condition_false && !was.condition_false,
                        &mut seen.condition_false,
                    ),
                    (is.xid && !was.xid, &mut seen.xid),
                ];
                for (turned, into) in turned {
                    if turned {
                        into.entry(node.name_any()).or_default().push(now);
                    }
                }
            }
        })
    }

    fn seen(&self) -> std::sync::MutexGuard<'_, Seen> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The first cordon of `node` seen after `since`.
    pub fn after(&self, node: &str, since: Instant) -> Option<Instant> {
        first_after(&self.seen().cordoned, node, since)
    }

    /// The first time after `since` that `node`'s [`CONDITION`] was seen
    /// `False`.
    pub fn condition_false(&self, node: &str, since: Instant) -> Option<Instant> {
        first_after(&self.seen().condition_false, node, since)
    }

    /// The first time after `since` that `node`'s report was seen naming an
    /// Xid, and the first cordon seen after that.
    pub fn xid_to_cordon(&self, node: &str, since: Instant) -> Option<(Instant, Instant)> {
        self.then_cordoned(|s| &s.xid, node, since)
    }

    /// The first time after `since` that `node`'s report was seen showing a
    /// bad GPU, and the first cordon seen after that.
    pub fn quarantine(&self, node: &str, since: Instant) -> Option<(Instant, Instant)> {
        self.then_cordoned(|s| &s.sick, node, since)
    }

    /// The first of `node`'s moments in `which` after `since`, and the first
    /// cordon seen after it.
    fn then_cordoned(
        &self,
        which: impl Fn(&Seen) -> &HashMap<String, Vec<Instant>>,
        node: &str,
        since: Instant,
    ) -> Option<(Instant, Instant)> {
        let seen = self.seen();
        let first = first_after(which(&seen), node, since)?;
        let cordoned = first_after(&seen.cordoned, node, first)?;
        Some((first, cordoned))
    }
}

/// Asks `seen` every 50 ms until it answers or `deadline` passes: what a
/// watch saw is read as it lands, its times taken by the watch itself, so
/// the poll's period is in no figure.
pub async fn awaited<T>(deadline: Instant, seen: impl Fn() -> Option<T>) -> Option<T> {
    loop {
        let answer = seen();
        if answer.is_some() || Instant::now() > deadline {
            return answer;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// The node condition the peer comparison writes and both tools react to,
/// as a node problem detector would set it: not `GpuHealthy`, which is
/// gpuhealth's agent's own and which no policy may act on.
pub const CONDITION: &str = "BenchGpuHealthy";

/// The first of `node`'s moments in `seen` at or after `since`.
pub fn first_after(
    seen: &HashMap<String, Vec<Instant>>,
    node: &str,
    since: Instant,
) -> Option<Instant> {
    seen.get(node)?.iter().copied().find(|t| *t >= since)
}

/// Marks the floor's nodes, which the bench policy does not select.
pub const FLOOR_LABEL: &str = "bench.gpuhealth.io/floor";

/// The floor: a watch on the fleet that cordons each of its nodes
/// ([`FLOOR_LABEL`]) whose report shows a GPU that is not healthy, with one
/// patch, and does nothing else.
pub fn floor(client: &Client) -> Background {
    let (nodes, config) = fleet_nodes(client);
    Background::spawn(async move {
        let mut stream = std::pin::pin!(applied(nodes.clone(), config));
        while let Some(node) = stream.next().await {
            if node.labels().contains_key(FLOOR_LABEL)
                && report(&node).is_some_and(|r| shows_a_bad_gpu(&r))
                && !is_cordoned(&node)
            {
                let nodes = nodes.clone();
                tokio::spawn(async move {
                    let patch = json!({"spec": {"unschedulable": true}});
                    let _ = nodes
                        .patch(
                            &node.name_any(),
                            &PatchParams::default(),
                            &Patch::Merge(patch),
                        )
                        .await;
                });
            }
        }
    })
}
