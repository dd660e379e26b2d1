//! The independent watcher of a chaos run: it records every change to a
//! simulation group's Nodes, Pods, `GpuNodeHealth` objects and gpuhealth's
//! `DeviceTaintRule`s for them, and the devices the pods' ResourceClaims
//! were allocated, in the order
//! the API server reports them, as [`Seen`] entries for
//! [`crate::invariants::check`]. It reads only the cluster, never the
//! operator, and keeps recording across API server restarts: a relist after
//! a gap reports what changed meanwhile (a pod missing from the relist is
//! gone).
//!
//! Long because it has one watch for each kind of object it records, each
//! turning its changes into entries; they share the timeline they feed.

use std::{
    collections::{BTreeMap, BTreeSet},
    sync::{Arc, Mutex},
    time::Duration,
};

use futures::StreamExt;
use gpuhealth_api::{
    GpuHealth, GpuNodeHealth,
    contract::{
        AnnotationValue, CORDONED_BY_ANNOTATION, DISRUPTION_TOLERANCE_ANNOTATION,
        REBOOT_REQUEST_ANNOTATION, RESET_REQUEST_ANNOTATION, RebootRequest, ResetRequest,
    },
};
use gpuhealth_api::{
    device_taint_rule::DeviceTaintRule,
    quarantine::{MANAGED_BY_LABEL, RULE_NODE_LABEL},
};
use k8s_openapi::api::{
    core::v1::{Node, Pod},
    resource::v1::ResourceClaim,
};
use kube::{Api, Client, ResourceExt, runtime::watcher};
use tokio::sync::{Notify, mpsc};

use crate::{
    Result, dra,
    invariants::{Seen, SimGpu, Target},
    node_agent::hardware,
    sim::{SIM_GROUP_LABEL, is_cordoned},
    wait::{Background, events, within},
};

/// Records until dropped.
pub struct Recorder {
    timeline: Arc<Mutex<Timeline>>,
    /// Woken on every entry.
    grew: Arc<Notify>,
    listed: mpsc::Receiver<()>,
    watches: Vec<Background>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The entries in the order the API server made the changes: by the
/// resourceVersion of the object each was read from. The watches deliver
/// in order each, but not with one another: a status could arrive seconds
/// after a cordon written after it (the Kubernetes resourceVersion is
/// opaque; here, one API server on one etcd, it is the etcd revision).
#[derive(Default)]
struct Timeline {
    seen: Vec<Seen>,
    versions: Vec<u64>,
    /// Entries before this were handed out by a mark and never move.
    frozen: usize,
    /// The highest version so far.
    latest: u64,
}

impl Timeline {
    /// Inserts `seen`, read from an object at `version` (None: not known,
    /// as for a pod found gone by a relist: after all so far).
    fn insert(&mut self, version: Option<u64>, seen: Seen) {
        let version = version.unwrap_or(self.latest);
        self.latest = self.latest.max(version);
        let mut at = self.seen.len();
        while at > self.frozen && self.versions[at - 1] > version {
            at -= 1;
        }
        self.seen.insert(at, seen);
        self.versions.insert(at, version);
    }
}

/// The resourceVersion of `object` as a number, where it is one.
fn version(object: &impl ResourceExt) -> Option<u64> {
    object.resource_version()?.parse().ok()
}

/// Puts entries into the timeline and wakes whoever waits on it.
#[derive(Clone)]
struct Sink(Arc<Mutex<Timeline>>, Arc<Notify>);

impl Sink {
    fn record(&self, version: Option<u64>, seen: impl IntoIterator<Item = Seen>) {
        let mut timeline = lock(&self.0);
        for s in seen {
            timeline.insert(version, s);
        }
        drop(timeline);
        self.1.notify_waiters();
    }
}

impl Recorder {
    /// Watches the nodes of simulation group `group` (and their
    /// `GpuNodeHealth`) and the pods in `namespace`.
    pub fn start(client: &Client, group: &str, namespace: &str) -> Recorder {
        let timeline: Arc<Mutex<Timeline>> = Arc::default();
        let grew: Arc<Notify> = Arc::default();
        let sink = Sink(timeline.clone(), grew.clone());
        let (tx, listed) = mpsc::channel(4);
        let nodes = {
            let api: Api<Node> = Api::all(client.clone());
            let config = watcher::Config::default().labels(&format!("{SIM_GROUP_LABEL}={group}"));
            let (sink, tx) = (sink.clone(), tx.clone());
            Background::spawn(async move {
                let mut last: BTreeMap<String, NodeSeen> = BTreeMap::new();
                let mut stream = std::pin::pin!(events(api, config));
                while let Some(event) = stream.next().await {
                    match event {
                        watcher::Event::Apply(n) | watcher::Event::InitApply(n) => {
                            let seen = last.entry(n.name_any()).or_default();
                            sink.record(version(&n), seen.changes(&n));
                        }
                        watcher::Event::InitDone => {
                            let _ = tx.try_send(());
                        }
                        _ => {}
                    }
                }
            })
        };
        let health = {
            let api: Api<GpuNodeHealth> = Api::all(client.clone());
            let prefix = format!("{group}-");
            let (sink, tx) = (sink.clone(), tx.clone());
            Background::spawn(async move {
                let mut last: BTreeMap<String, Seen> = BTreeMap::new();
                // A relist is the cluster at one instant: it is applied
                // whole at its end.
                let mut relist: Vec<(Option<u64>, Seen)> = Vec::new();
                let mut stream = std::pin::pin!(events(api, watcher::Config::default()));
                while let Some(event) = stream.next().await {
                    let (g, listing) = match event {
                        watcher::Event::Apply(g) => (g, false),
                        watcher::Event::InitApply(g) => (g, true),
                        watcher::Event::Init => {
                            relist.clear();
                            continue;
                        }
                        watcher::Event::InitDone => {
                            for (at, seen) in relist.drain(..) {
                                if let Seen::Health { node, .. } = &seen
                                    && last.get(node) != Some(&seen)
                                {
                                    last.insert(node.clone(), seen.clone());
                                    sink.record(at, [seen]);
                                }
                            }
                            let _ = tx.try_send(());
                            continue;
                        }
                        watcher::Event::Delete(_) => continue,
                    };
                    let node = g.name_any();
                    if !node.starts_with(&prefix) {
                        continue;
                    }
                    let at = version(&g);
                    let status = g.status.unwrap_or_default();
                    let seen = Seen::Health {
                        node: node.clone(),
                        policy: status.policy,
                        phase: status.phase,
                        reason: status.reason,
                    };
                    if listing {
                        relist.push((at, seen));
                    } else if last.get(&node) != Some(&seen) {
                        last.insert(node, seen.clone());
                        sink.record(at, [seen]);
                    }
                }
            })
        };
        let pods = {
            let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
            let (sink, tx) = (sink.clone(), tx.clone());
            Background::spawn(async move {
                let mut known: BTreeMap<String, PodSeen> = BTreeMap::new();
                let mut relisted: BTreeSet<String> = BTreeSet::new();
                let mut stream = std::pin::pin!(events(api, watcher::Config::default()));
                while let Some(event) = stream.next().await {
                    match event {
                        watcher::Event::Apply(p) | watcher::Event::InitApply(p) => {
                            relisted.insert(key(&p));
                            let now = PodSeen::of(&p);
                            let before = known.insert(key(&p), now.clone());
                            if before.is_none_or(|b| b.node != now.node) {
                                sink.record(
                                    version(&p),
                                    [Seen::PodUp {
                                        pod: key(&p),
                                        node: now.node,
                                    }],
                                );
                            }
                        }
                        watcher::Event::Init => relisted.clear(),
                        watcher::Event::InitDone => {
                            let gone: Vec<String> = known
                                .keys()
                                .filter(|k| !relisted.contains(*k))
                                .cloned()
                                .collect();
                            for pod in gone {
                                // Deleted while the watch was down, at a
                                // version unknown: taken as right after the
                                // last one seen (a request written after the
                                // deletion, read in the nodes' relist, is
                                // then not placed before it).
                                let last = known.remove(&pod).unwrap_or_default();
                                sink.record(last.version, [last.gone(pod)]);
                            }
                            let _ = tx.try_send(());
                        }
                        watcher::Event::Delete(p) => {
                            let last = known.remove(&key(&p));
                            let mut now = PodSeen::of(&p);
                            now.evicted |= last.is_some_and(|l| l.evicted);
                            sink.record(version(&p), [now.gone(key(&p))]);
                        }
                    }
                }
            })
        };
        let fences = {
            let client = client.clone();
            let config = watcher::Config::default()
                .labels(&format!("{}={}", MANAGED_BY_LABEL.0, MANAGED_BY_LABEL.1));
            let prefix = format!("{group}-");
            let (sink, tx) = (sink.clone(), tx.clone());
            Background::spawn(async move {
                // Rule name -> its node, for the rules of this group's nodes.
                let mut up: BTreeMap<String, String> = BTreeMap::new();
                let mut relisted: BTreeSet<String> = BTreeSet::new();
                let node_of = |r: &DeviceTaintRule| {
                    r.labels()
                        .get(RULE_NODE_LABEL)
                        .filter(|n| n.starts_with(&prefix))
                        .cloned()
                };
                // A cluster that serves no rules has none to list or record.
                let Some(api) = dra::rules_once_answered(&client).await else {
                    let _ = tx.try_send(());
                    return;
                };
                let mut stream = std::pin::pin!(events(api, config));
                while let Some(event) = stream.next().await {
                    match event {
                        watcher::Event::Apply(r) | watcher::Event::InitApply(r) => {
                            relisted.insert(r.name_any());
                            let Some(node) = node_of(&r) else { continue };
                            if up.insert(r.name_any(), node.clone()).is_none() {
                                let device = r
                                    .spec
                                    .device_selector
                                    .as_ref()
                                    .and_then(|s| s.device.clone());
                                sink.record(
                                    version(&r),
                                    [Seen::Fence {
                                        node,
                                        rule: r.name_any(),
                                        up: true,
                                        device,
                                    }],
                                );
                            }
                        }
                        watcher::Event::Init => relisted.clear(),
                        watcher::Event::InitDone => {
                            let gone: Vec<String> = up
                                .keys()
                                .filter(|k| !relisted.contains(*k))
                                .cloned()
                                .collect();
                            for rule in gone {
                                if let Some(node) = up.remove(&rule) {
                                    sink.record(
                                        None,
                                        [Seen::Fence {
                                            node,
                                            rule,
                                            up: false,
                                            device: None,
                                        }],
                                    );
                                }
                            }
                            let _ = tx.try_send(());
                        }
                        watcher::Event::Delete(r) => {
                            if let Some(node) = up.remove(&r.name_any()) {
                                sink.record(
                                    version(&r),
                                    [Seen::Fence {
                                        node,
                                        rule: r.name_any(),
                                        up: false,
                                        device: None,
                                    }],
                                );
                            }
                        }
                    }
                }
            })
        };
        let claims = {
            let api: Api<ResourceClaim> = Api::namespaced(client.clone(), namespace);
            let prefix = format!("{group}-");
            Background::spawn(async move {
                // What each claim was last seen allocated to whom.
                let mut known: BTreeMap<String, Vec<Seen>> = BTreeMap::new();
                let mut stream = std::pin::pin!(events(api, watcher::Config::default()));
                while let Some(event) = stream.next().await {
                    match event {
                        watcher::Event::Apply(c) | watcher::Event::InitApply(c) => {
                            let now = holders(&c, &prefix);
                            let before = known.insert(c.name_any(), now.clone());
                            let new: Vec<Seen> = now
                                .into_iter()
                                .filter(|s| !before.iter().flatten().any(|b| b == s))
                                .collect();
                            sink.record(version(&c), new);
                        }
                        watcher::Event::InitDone => {
                            let _ = tx.try_send(());
                        }
                        watcher::Event::Delete(c) => {
                            known.remove(&c.name_any());
                        }
                        watcher::Event::Init => {}
                    }
                }
            })
        };
        Recorder {
            timeline,
            grew,
            listed,
            watches: vec![nodes, health, pods, fences, claims],
        }
    }

    /// Waits until each watch has its first list, so that nothing done
    /// after this goes unseen.
    pub async fn ready(&mut self) -> Result<()> {
        within(
            "the recorder's first lists",
            Duration::from_secs(60),
            async {
                for _ in 0..self.watches.len() {
                    self.listed.recv().await;
                }
                Ok(())
            },
        )
        .await
    }

    /// How many entries are recorded: a mark for [`Recorder::since`]. An
    /// entry arriving later is never put before it.
    pub fn mark(&self) -> usize {
        let mut timeline = lock(&self.timeline);
        timeline.frozen = timeline.seen.len();
        timeline.frozen
    }

    /// Waits until `done` holds for what was recorded since `mark`.
    pub async fn until(
        &self,
        mark: usize,
        what: &str,
        timeout: Duration,
        done: impl Fn(&[Seen]) -> bool,
    ) -> Result<()> {
        within(what, timeout, async {
            loop {
                // Registered before the check, so that no entry slips
                // between the check and the wait.
                let grew = self.grew.notified();
                let mut grew = std::pin::pin!(grew);
                grew.as_mut().enable();
                if done(&self.since(mark)) {
                    return Ok(());
                }
                grew.await;
            }
        })
        .await
    }

    /// Everything recorded since `mark`.
    pub fn since(&self, mark: usize) -> Vec<Seen> {
        lock(&self.timeline)
            .seen
            .get(mark..)
            .map(<[Seen]>::to_vec)
            .unwrap_or_default()
    }
}

/// Who holds what by `claim`: each pod it is reserved for holds each device
/// of the simulated driver it was allocated on a node whose name starts
/// with `prefix` (the driver's pool is the node).
fn holders(claim: &ResourceClaim, prefix: &str) -> Vec<Seen> {
    let Some(status) = &claim.status else {
        return Vec::new();
    };
    let namespace = claim.namespace().unwrap_or_default();
    let pods = status
        .reserved_for
        .iter()
        .flatten()
        .filter(|r| r.resource == "pods");
    let devices = status
        .allocation
        .iter()
        .filter_map(|a| a.devices.as_ref())
        .flat_map(|d| d.results.iter().flatten())
        .filter(|r| r.driver == dra::DRIVER && r.pool.starts_with(prefix));
    pods.flat_map(|p| {
        devices.clone().map(|d| Seen::Claimed {
            pod: format!("{namespace}/{}", p.name),
            node: d.pool.clone(),
            device: d.device.clone(),
        })
    })
    .collect()
}

fn key(pod: &Pod) -> String {
    format!("{}/{}", pod.namespace().unwrap_or_default(), pod.name_any())
}

/// What was last seen of one pod.
#[derive(Clone, Default)]
struct PodSeen {
    node: Option<String>,
    never: bool,
    evicted: bool,
    /// The resourceVersion it was last seen at.
    version: Option<u64>,
}

impl PodSeen {
    fn of(pod: &Pod) -> PodSeen {
        let conditions = pod.status.as_ref().and_then(|s| s.conditions.as_ref());
        PodSeen {
            node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
            never: pod
                .annotations()
                .get(DISRUPTION_TOLERANCE_ANNOTATION)
                .is_some_and(|v| v == "never"),
            // What the API server's Eviction API marks a pod with.
            evicted: conditions.is_some_and(|c| {
                c.iter().any(|c| {
                    c.type_ == "DisruptionTarget"
                        && c.reason.as_deref() == Some("EvictionByEvictionAPI")
                })
            }),
            version: version(pod),
        }
    }

    fn gone(self, pod: String) -> Seen {
        Seen::PodGone {
            pod,
            never: self.never,
            evicted: self.evicted,
        }
    }
}

/// What was last seen of one node.
#[derive(Default)]
struct NodeSeen {
    cordoned: Option<(bool, bool)>,
    gpus: Option<Vec<SimGpu>>,
    requests: BTreeMap<&'static str, String>,
    /// How many times the simulated hardware shows each request carried out.
    executed: BTreeMap<String, usize>,
}

impl NodeSeen {
    fn changes(&mut self, node: &Node) -> Vec<Seen> {
        let name = node.name_any();
        let mut changes = Vec::new();
        // A relist (after an API server restart) can show several writes
        // at once, in no known order: the hardware first, then the cordon,
        // then requests, the order that invents no violation (a mend and
        // the uncordon after it; a cordon and the request after it).
        let hw = hardware(node);
        let gpus: Vec<SimGpu> = hw
            .iter()
            .flat_map(|h| &h.gpus)
            .map(|g| SimGpu {
                uuid: g.uuid.clone(),
                device: dra::device_name(g.index),
                bad: g.health != GpuHealth::Healthy,
                pods: g
                    .pods
                    .iter()
                    .map(|p| format!("{}/{}", p.namespace, p.name))
                    .collect(),
            })
            .collect();
        if self.gpus.as_ref() != Some(&gpus) {
            self.gpus = Some(gpus.clone());
            changes.push(Seen::Hardware {
                node: name.clone(),
                gpus,
            });
        }
        let cordoned = (
            is_cordoned(node),
            node.annotations().contains_key(CORDONED_BY_ANNOTATION),
        );
        if self.cordoned != Some(cordoned) {
            self.cordoned = Some(cordoned);
            changes.push(Seen::Cordon {
                node: name.clone(),
                unschedulable: cordoned.0,
                ours: cordoned.1,
            });
        }
        for key in [RESET_REQUEST_ANNOTATION, REBOOT_REQUEST_ANNOTATION] {
            let Some(value) = node.annotations().get(key) else {
                continue;
            };
            if self.requests.get(key) == Some(value) {
                continue;
            }
            self.requests.insert(key, value.clone());
            let read = if key == RESET_REQUEST_ANNOTATION {
                ResetRequest::parse(value).map(|r| (r.id.to_string(), Target::Gpus(r.gpus)))
            } else {
                RebootRequest::parse(value).map(|r| (r.id.to_string(), Target::Node))
            };
            let (id, target) =
                read.unwrap_or_else(|e| (format!("unreadable: {e}"), Target::Unreadable));
            changes.push(Seen::Request {
                node: name.clone(),
                id,
                value: value.clone(),
                target,
            });
        }
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for id in hw.map(|h| h.executed).unwrap_or_default() {
            *counts.entry(id).or_default() += 1;
        }
        for (id, count) in counts {
            let before = self.executed.get(&id).copied().unwrap_or_default();
            for _ in before..count {
                changes.push(Seen::Executed {
                    node: name.clone(),
                    id: id.clone(),
                });
            }
            if count > before {
                self.executed.insert(id, count);
            }
        }
        changes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cordon(node: &str) -> Seen {
        Seen::Cordon {
            node: node.into(),
            unschedulable: true,
            ours: true,
        }
    }

    fn nodes(t: &Timeline) -> Vec<&str> {
        t.seen
            .iter()
            .map(|s| match s {
                Seen::Cordon { node, .. } => node.as_str(),
                _ => "",
            })
            .collect()
    }

    #[test]
    fn a_late_entry_takes_its_place_by_version_but_never_before_a_mark() {
        let mut t = Timeline::default();
        t.insert(Some(10), cordon("a"));
        t.insert(Some(30), cordon("c"));
        // Delivered late by another watch: it happened before c.
        t.insert(Some(20), cordon("b"));
        // Same version (one observation): in the order given.
        t.insert(Some(20), cordon("b2"));
        assert_eq!(nodes(&t), ["a", "b", "b2", "c"]);
        t.frozen = t.seen.len();
        t.insert(Some(5), cordon("late"));
        t.insert(None, cordon("unknown"));
        t.insert(Some(6), cordon("after"));
        assert_eq!(nodes(&t), ["a", "b", "b2", "c", "late", "after", "unknown"]);
    }
}
