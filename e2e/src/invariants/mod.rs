//! The promises a chaos run checks afterwards, over what an independent
//! watcher saw during the run, in the order it saw it. It judges from the
//! cluster's own objects: a node is disrupted while it carries gpuhealth's
//! cordon or one of its `DeviceTaintRule`s, a GPU is bad while the
//! simulated hardware says so, a pod holds a GPU while it exists and the
//! hardware shows it there or a ResourceClaim reserved for it was allocated
//! the GPU's device. It imports
//! nothing of gpuhealth but the names of its annotations and labels, and
//! trusts a `GpuNodeHealth` status only for what a status promises (how a
//! sick node ends) and for a handover (a `Failed` node is a person's).
//! Pure, so that each check is tested with no cluster against the
//! violation it must catch (`tests.rs`).

use std::collections::{BTreeMap, BTreeSet};

use gpuhealth_api::{node_health::Phase, vocabulary::Reason};

mod queries;
#[cfg(test)]
mod tests;

pub use queries::{carries_cordon_record, cordoned, ending, fences_up, latest_phase, pod_up};

/// One change seen on a watch.
#[derive(Clone, Debug, PartialEq)]
pub enum Seen {
    /// A node's `GpuNodeHealth` status.
    Health {
        node: String,
        policy: Option<String>,
        phase: Phase,
        reason: Option<Reason>,
    },
    /// A node's `spec.unschedulable`, and whether gpuhealth's cordon record
    /// was on the node with it.
    Cordon {
        node: String,
        unschedulable: bool,
        ours: bool,
    },
    /// A node's simulated GPUs as they changed: the truth a real node's
    /// hardware would hold.
    Hardware { node: String, gpus: Vec<SimGpu> },
    /// A pod first seen in the cluster (`namespace/name`), on `node`.
    PodUp { pod: String, node: Option<String> },
    /// A pod gone from the cluster (`namespace/name`), whether it was
    /// annotated `gpuhealth.io/disruption-tolerance: never`, and whether it
    /// went through the Eviction API (the API server marks such a pod with
    /// a `DisruptionTarget` condition before it goes).
    PodGone {
        pod: String,
        never: bool,
        evicted: bool,
    },
    /// The agent carried out request `id` on `node` (as the simulated
    /// hardware recorded it).
    Executed { node: String, id: String },
    /// A reset or reboot request annotation on `node`, whole, and what it
    /// acts on.
    Request {
        node: String,
        id: String,
        value: String,
        target: Target,
    },
    /// One of gpuhealth's `DeviceTaintRule`s for `node`, up or gone, and
    /// the device it taints (as its selector names it) when up.
    Fence {
        node: String,
        rule: String,
        up: bool,
        device: Option<String>,
    },
    /// A ResourceClaim reserved for `pod` (`namespace/name`) was allocated
    /// `device` of `node`: the pod holds that GPU for as long as it exists.
    Claimed {
        pod: String,
        node: String,
        device: String,
    },
}

/// What a request acts on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// A reset of these GPUs (UUIDs).
    Gpus(Vec<String>),
    /// A reboot: every GPU of the node.
    Node,
    /// Nothing: no agent acts on a value it cannot read (a hostile
    /// writer's), so it is judged only for being rewritten.
    Unreadable,
}

/// One simulated GPU: its UUID, the name of the DRA device a driver
/// publishes it as, whether it is bad (anything but healthy), and the pods
/// (`namespace/name`) the hardware shows running on it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimGpu {
    pub uuid: String,
    pub device: String,
    pub bad: bool,
    pub pods: Vec<String>,
}

/// What the run set up, against which the timeline is judged.
#[derive(Clone, Debug, Default)]
pub struct Expectations {
    /// Each policy's `maxConcurrent`, as a node count.
    pub max_concurrent: BTreeMap<String, usize>,
    /// Nodes the run cordoned itself before the timeline starts and left
    /// cordoned: nobody else may uncordon them.
    pub foreign_cordons: BTreeSet<String>,
    /// Pods the run deleted itself.
    pub deleted_by_run: BTreeSet<String>,
    /// Nodes the run made sick, with how each must end: `Healthy`, or
    /// `Failed` with a reason.
    pub sick: BTreeMap<String, Phase>,
}

/// A broken promise, with what shows it.
#[derive(Clone, Debug, PartialEq)]
pub enum Violation {
    /// More of a policy's nodes disrupted at once than `maxConcurrent`.
    OverBudget {
        policy: String,
        limit: usize,
        disrupted: Vec<String>,
    },
    ForeignUncordon {
        node: String,
    },
    NeverPodEvicted {
        pod: String,
    },
    ExecutedTwice {
        node: String,
        id: String,
    },
    /// One request id written with two different values: the agent may
    /// have read either.
    RequestRewritten {
        node: String,
        id: String,
    },
    /// Something the scenario sets out to show did not happen (the circuit
    /// breaker never opened in a storm).
    Missing {
        what: String,
    },
    NotSettled {
        node: String,
        expected: Phase,
        phase: Option<Phase>,
        reason: Option<Reason>,
    },
    /// A pod evicted or a request written (`what`) on a node neither
    /// cordoned nor with a GPU fenced: new work could land on its bad GPU.
    Unfenced {
        node: String,
        what: String,
    },
    /// A rule still up for a node back in service: its GPU fenced forever.
    RuleOutlivedIncident {
        node: String,
        rule: String,
    },
    /// A reset or reboot requested while a pod holds one of its GPUs (the
    /// hardware shows it there, or its claim was allocated the GPU's
    /// device): the drain had not finished, or missed a newcomer.
    RequestWhileHeld {
        node: String,
        id: String,
        pod: String,
    },
    /// A reset or reboot carried out (as the hardware recorded it) while a
    /// pod held one of its GPUs: one that came to hold it after the
    /// request was written, and was never drained.
    CarriedOutWhileHeld {
        node: String,
        id: String,
        pod: String,
    },
    /// gpuhealth's cordon still on a node that ended `Healthy`.
    CordonOutlivedIncident {
        node: String,
    },
    /// gpuhealth's cordon lifted while the node's hardware still had a bad
    /// GPU.
    UncordonedWhileBad {
        node: String,
    },
    /// A pod evicted from a node fenced only GPU by GPU, though it held no
    /// GPU that was bad or fenced: outside the drain's scope.
    EvictedOutsideScope {
        pod: String,
        node: String,
    },
    /// A write by a replica that did not hold the Lease when the API
    /// server received it (from the audit log: [`crate::audit`]).
    WriteWithoutLease {
        replica: String,
        holder: String,
        what: String,
        at: String,
    },
}

/// What the judge knows of one node at a point of the timeline.
#[derive(Default)]
struct NodeNow<'a> {
    health: Option<(&'a Option<String>, Phase, &'a Option<Reason>)>,
    unschedulable: bool,
    /// gpuhealth's cordon is on it.
    ours: bool,
    /// Its rules up, each with the device it taints.
    rules: BTreeMap<&'a str, Option<&'a str>>,
    gpus: &'a [SimGpu],
    /// Per device, the pods whose claims were allocated it.
    claimed: BTreeMap<&'a str, BTreeSet<&'a str>>,
}

impl NodeNow<'_> {
    fn fenced(&self) -> bool {
        self.unschedulable || !self.rules.is_empty()
    }

    /// Out of service on gpuhealth's account: its cordon or a rule of its
    /// on the node, whatever the status says, unless the node was handed
    /// over to a person (`Failed`): what `maxConcurrent` bounds.
    fn disrupted(&self) -> bool {
        (self.ours && self.unschedulable || !self.rules.is_empty())
            && !matches!(self.health, Some((_, Phase::Failed, _)))
    }

    fn bad(&self) -> bool {
        self.gpus.iter().any(|g| g.bad)
    }

    /// The pods that hold `gpu`, of those that exist.
    fn holders<'p>(
        &'p self,
        gpu: &'p SimGpu,
        pods: &'p BTreeMap<&str, Option<&str>>,
    ) -> impl Iterator<Item = &'p str> {
        let claimed = self.claimed.get(gpu.device.as_str()).into_iter().flatten();
        gpu.pods
            .iter()
            .map(String::as_str)
            .chain(claimed.copied())
            .filter(|p| pods.contains_key(p))
    }

    /// A pod that holds a GPU `target` acts on, if one does.
    fn held<'p>(
        &'p self,
        target: &Target,
        pods: &'p BTreeMap<&str, Option<&str>>,
    ) -> Option<&'p str> {
        let acts_on = |g: &SimGpu| match target {
            Target::Gpus(these) => these.contains(&g.uuid),
            Target::Node => true,
            Target::Unreadable => false,
        };
        self.gpus
            .iter()
            .filter(|g| acts_on(g))
            .find_map(|g| self.holders(g, pods).next())
    }

    /// Whether `pod` holds `gpu`, whether or not it still exists.
    fn holds(&self, gpu: &SimGpu, pod: &str) -> bool {
        gpu.pods.iter().any(|p| p == pod)
            || self
                .claimed
                .get(gpu.device.as_str())
                .is_some_and(|c| c.contains(pod))
    }

    /// Whether `gpu` is bad or one of the node's rules taints its device.
    fn out_of_service(&self, gpu: &SimGpu) -> bool {
        gpu.bad || self.rules.values().any(|d| *d == Some(gpu.device.as_str()))
    }
}

/// Every promise `timeline` breaks; empty when it keeps them all.
pub fn check(timeline: &[Seen], expect: &Expectations) -> Vec<Violation> {
    check_from(timeline, 0, expect)
}

/// Every promise the entries of `timeline` from `from` on break, judged
/// with what the entries before told (the pods that exist, the cordons and
/// rules up, the hardware), so that a trial is judged on the cluster as it
/// stood when it began.
pub fn check_from(timeline: &[Seen], from: usize, expect: &Expectations) -> Vec<Violation> {
    let mut violations = Vec::new();
    let mut nodes: BTreeMap<&str, NodeNow> = BTreeMap::new();
    for foreign in &expect.foreign_cordons {
        nodes.entry(foreign).or_default().unschedulable = true;
    }
    // The run's cordons made before the timeline starts.
    let mut foreign_on: BTreeSet<&str> =
        expect.foreign_cordons.iter().map(String::as_str).collect();
    let mut executed: BTreeSet<(&str, &str)> = BTreeSet::new();
    let mut requests: BTreeMap<(&str, &str), &str> = BTreeMap::new();
    let mut targets: BTreeMap<(&str, &str), &Target> = BTreeMap::new();
    // Pods that exist, with their node.
    let mut pods: BTreeMap<&str, Option<&str>> = BTreeMap::new();
    // Each policy's worst moment, reported once.
    let mut over: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut unfenced: BTreeSet<&str> = BTreeSet::new();
    let mut bad_uncordons: BTreeSet<&str> = BTreeSet::new();
    for (i, seen) in timeline.iter().enumerate() {
        if i == from {
            // Judging starts: what was reported of the past is forgotten.
            violations.clear();
            unfenced.clear();
            bad_uncordons.clear();
            over.clear();
        }
        match seen {
            Seen::Health {
                node,
                policy,
                phase,
                reason,
            } => {
                nodes.entry(node).or_default().health = Some((policy, *phase, reason));
            }
            Seen::Cordon {
                node,
                unschedulable,
                ours,
            } => {
                let now = nodes.entry(node).or_default();
                if now.ours
                    && now.unschedulable
                    && !unschedulable
                    && now.bad()
                    && bad_uncordons.insert(node)
                {
                    violations.push(Violation::UncordonedWhileBad { node: node.clone() });
                }
                now.unschedulable = *unschedulable;
                now.ours = *ours;
                // Not `continue`: a cordon goes on to the budget's judgement.
                if expect.foreign_cordons.contains(node) {
                    if *unschedulable {
                        foreign_on.insert(node);
                    } else if foreign_on.remove(node.as_str()) {
                        violations.push(Violation::ForeignUncordon { node: node.clone() });
                    }
                }
            }
            Seen::Hardware { node, gpus } => nodes.entry(node).or_default().gpus = gpus,
            Seen::PodUp { pod, node } => {
                pods.insert(pod, node.as_deref());
            }
            Seen::PodGone {
                pod,
                never,
                evicted,
            } => {
                let node = pods.remove(pod.as_str()).flatten();
                if *never && !expect.deleted_by_run.contains(pod) {
                    violations.push(Violation::NeverPodEvicted { pod: pod.clone() });
                }
                let held_in_scope = node.and_then(|n| nodes.get(n)).is_some_and(|now| {
                    now.gpus
                        .iter()
                        .any(|g| now.out_of_service(g) && now.holds(g, pod))
                });
                // Its claims go with it: a pod of the same name later is
                // another pod.
                for now in nodes.values_mut() {
                    for holders in now.claimed.values_mut() {
                        holders.remove(pod.as_str());
                    }
                }
                let (true, Some(node)) = (*evicted, node) else {
                    continue;
                };
                let now = nodes.entry(node).or_default();
                if !now.fenced() {
                    if unfenced.insert(node) {
                        violations.push(Violation::Unfenced {
                            node: node.to_owned(),
                            what: format!("{pod} evicted"),
                        });
                    }
                } else if !now.unschedulable && !held_in_scope {
                    violations.push(Violation::EvictedOutsideScope {
                        pod: pod.clone(),
                        node: node.to_owned(),
                    });
                }
            }
            Seen::Executed { node, id } => {
                if !executed.insert((node, id)) {
                    violations.push(Violation::ExecutedTwice {
                        node: node.clone(),
                        id: id.clone(),
                    });
                }
                let now = nodes.entry(node).or_default();
                let held = targets
                    .get(&(node.as_str(), id.as_str()))
                    .and_then(|t| now.held(t, &pods));
                if let Some(pod) = held {
                    violations.push(Violation::CarriedOutWhileHeld {
                        node: node.clone(),
                        id: id.clone(),
                        pod: pod.to_owned(),
                    });
                }
            }
            Seen::Request {
                node,
                id,
                value,
                target,
            } => {
                // Judged when first written; a later value must be the same.
                if let Some(first) = requests.insert((node, id), value) {
                    if first != value {
                        violations.push(Violation::RequestRewritten {
                            node: node.clone(),
                            id: id.clone(),
                        });
                    }
                    continue;
                }
                if *target == Target::Unreadable {
                    continue;
                }
                targets.insert((node, id), target);
                let now = nodes.entry(node).or_default();
                if !now.fenced() && unfenced.insert(node) {
                    violations.push(Violation::Unfenced {
                        node: node.clone(),
                        what: format!("request {id}"),
                    });
                }
                if let Some(pod) = now.held(target, &pods) {
                    violations.push(Violation::RequestWhileHeld {
                        node: node.clone(),
                        id: id.clone(),
                        pod: pod.to_owned(),
                    });
                }
            }
            Seen::Fence {
                node,
                rule,
                up,
                device,
            } => {
                let rules = &mut nodes.entry(node).or_default().rules;
                if *up {
                    rules.insert(rule, device.as_deref());
                } else {
                    rules.remove(rule.as_str());
                }
            }
            Seen::Claimed { pod, node, device } => {
                nodes
                    .entry(node)
                    .or_default()
                    .claimed
                    .entry(device)
                    .or_default()
                    .insert(pod);
            }
        }
        if let Some(policy) = raised_fence(seen, &nodes) {
            let disrupted: Vec<String> = nodes
                .iter()
                .filter(|(_, n)| n.disrupted() && policy_of(n) == Some(policy))
                .map(|(name, _)| (*name).to_owned())
                .collect();
            let limit = expect
                .max_concurrent
                .get(policy)
                .copied()
                .unwrap_or(usize::MAX);
            let worst = over.get(policy).map_or(limit, Vec::len);
            if disrupted.len() > worst && i >= from {
                over.insert(policy.to_owned(), disrupted);
            }
        }
    }
    if from >= timeline.len() {
        violations.clear();
    }
    for (node, now) in &nodes {
        let healthy = matches!(now.health, Some((_, Phase::Healthy, _)));
        if healthy {
            for rule in now.rules.keys() {
                violations.push(Violation::RuleOutlivedIncident {
                    node: (*node).to_owned(),
                    rule: (*rule).to_owned(),
                });
            }
            if now.ours && now.unschedulable {
                violations.push(Violation::CordonOutlivedIncident {
                    node: (*node).to_owned(),
                });
            }
        }
    }
    for (policy, disrupted) in over {
        violations.push(Violation::OverBudget {
            limit: expect
                .max_concurrent
                .get(&policy)
                .copied()
                .unwrap_or(usize::MAX),
            policy,
            disrupted,
        });
    }
    for (node, expected) in &expect.sick {
        let last = nodes.get(node.as_str()).and_then(|n| n.health);
        let settled = match last {
            Some((_, Phase::Healthy, _)) => *expected == Phase::Healthy,
            Some((_, Phase::Failed, reason)) => *expected == Phase::Failed && reason.is_some(),
            _ => false,
        };
        if !settled {
            violations.push(Violation::NotSettled {
                node: node.clone(),
                expected: *expected,
                phase: last.map(|(_, p, _)| p),
                reason: last.and_then(|(_, _, r)| *r),
            });
        }
    }
    violations
}

/// The policy whose count of disrupted nodes `seen` may have changed.
/// The policy of the node on which `seen` puts up a fence of gpuhealth's
/// (its cordon, or a rule): the moments the budget is judged, since only
/// a new fence takes a node out of service. A fence lifted, or a status
/// that changes while fences stand (handed-over nodes given back, their
/// statuses `Healthy` a moment before their rules go), disrupts nothing.
fn raised_fence<'a>(seen: &Seen, nodes: &BTreeMap<&str, NodeNow<'a>>) -> Option<&'a str> {
    let node = match seen {
        Seen::Cordon {
            node,
            unschedulable: true,
            ours: true,
        }
        | Seen::Fence { node, up: true, .. } => node,
        _ => return None,
    };
    nodes.get(node.as_str()).and_then(policy_of)
}

/// The policy a node's status names (which policy selects it).
fn policy_of<'a>(now: &NodeNow<'a>) -> Option<&'a str> {
    now.health.and_then(|(p, _, _)| p.as_deref())
}
