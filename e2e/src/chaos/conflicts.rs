//! Conflicting writers: while remediations run, another process keeps
//! rewriting the same nodes and pods the way `kubectl edit` does (read,
//! change, replace with the resourceVersion read, so that either side's
//! stale write is refused with 409): a label and an annotation of its own
//! on the nodes, and gpuhealth's own `disruption-tolerance` annotation on
//! the pods (between unset and `evict`, which mean the same). Each trial a
//! person also cordons one random node, which must stay cordoned. Nothing
//! may be lost: every node ends with the writer's last label, and gpuhealth
//! leaves no cordon of its own on a healthy node.

use std::{
    collections::BTreeMap,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use gpuhealth_api::{
    contract::{CORDONED_BY_ANNOTATION, DISRUPTION_TOLERANCE_ANNOTATION},
    node_health::Phase,
};
use k8s_openapi::{
    api::core::v1::{Node, Pod},
    apimachinery::pkg::util::intstr::IntOrString,
};
use kube::{
    Api, Client, ResourceExt,
    api::{ListParams, PostParams},
};
use tokio::sync::Mutex;

use super::{Fault, Rng, Row, fleet::Fleet, policy};
use crate::{
    Result,
    invariants::{Violation, cordoned, latest_phase},
    sim::{is_cordoned, set_cordon},
    wait::Background,
};

const LABEL: &str = "chaos.gpuhealth.io/toggle";

pub async fn run(trials: usize, rng: &mut Rng) -> Result<Row> {
    let spec = policy(2, IntOrString::String("100%".into()));
    let mut fleet = Fleet::new("chaos-conflict", 6, spec, 2).await?;
    let mut row = Row::new("conflicting writers");
    let writer = Writer::start(&fleet, rng.next_u64());
    for _ in 0..trials {
        let person = rng.pick(&fleet.s.nodes, 1).remove(0);
        set_cordon(&fleet.s.client, &person, true).await?;
        fleet.foreign_cordons.insert(person.clone());
        let faulty = 1 + rng.below(3);
        let kinds = [Fault::ResetHeals, Fault::RebootHeals, Fault::Hopeless];
        let (expect, mut violations) = fleet
            .trial(rng, faulty, &kinds, async |fleet, _| {
                writer.aim_at(&fleet.trial_sick);
                Ok(Vec::new())
            })
            .await?;
        violations.extend(writer.lost_updates(&fleet).await?);
        eprintln!("chaos: in this trial {person} was cordoned by a person");
        row.add_trial(&expect, violations);
        // The person's cordon ends (if a repair has not ended it already);
        // the next trial starts once the recorder has seen it.
        fleet.foreign_cordons.clear();
        set_cordon(&fleet.s.client, &person, false).await?;
        fleet
            .recorder
            .until(0, "the person's uncordon", super::fleet::SETTLE, |t| {
                cordoned(t, &person) == Some(false)
            })
            .await?;
    }
    let (writes, conflicts) = writer.counts();
    row.notes.push(format!(
        "the other writer replaced nodes and pods {writes} times; {conflicts} of its writes were refused with 409 and retried"
    ));
    let leader = fleet.live_leader().await?;
    if let Some(replica) = fleet.replicas.iter().find(|r| r.name == leader) {
        let (writes, conflicts) = operator_writes(&replica.scrape().await?);
        row.notes.push(format!(
            "the operator's leader made {writes} writes; {conflicts} were refused with 409 and decided again"
        ));
    }
    fleet.add_notes(&mut row);
    Ok(row)
}

/// The other writer, until dropped.
struct Writer {
    /// The label value it last wrote on each node; held while it writes, so
    /// that a check never sees a write half done.
    last: Arc<Mutex<BTreeMap<String, String>>>,
    /// The nodes it writes to: the running trial's sick ones, where the
    /// operator and the agents write too.
    aim: Arc<std::sync::Mutex<Vec<String>>>,
    writes: Arc<AtomicUsize>,
    conflicts: Arc<AtomicUsize>,
    _task: Background,
}

impl Writer {
    fn start(fleet: &Fleet, seed: u64) -> Writer {
        let last: Arc<Mutex<BTreeMap<String, String>>> = Arc::default();
        let writes: Arc<AtomicUsize> = Arc::default();
        let conflicts: Arc<AtomicUsize> = Arc::default();
        let aim = Arc::new(std::sync::Mutex::new(fleet.s.nodes.clone()));
        let (client, namespace) = (fleet.s.client.clone(), fleet.s.namespace.clone());
        let task = {
            let (last, writes, conflicts, aim) =
                (last.clone(), writes.clone(), conflicts.clone(), aim.clone());
            Background::spawn(async move {
                let mut rng = Rng::new(seed);
                for n in 0u64.. {
                    tokio::time::sleep(
                        Duration::from_millis(50) + rng.within(Duration::from_millis(150)),
                    )
                    .await;
                    let node = {
                        let nodes = aim.lock().unwrap_or_else(|p| p.into_inner());
                        nodes[rng.below(nodes.len())].clone()
                    };
                    let delay = rng.within(Duration::from_secs(1));
                    let mut last = last.lock().await;
                    let result = if n % 2 == 0 {
                        replace_node(&client, &node, &n.to_string(), delay)
                            .await
                            .map(|()| {
                                last.insert(node, n.to_string());
                            })
                    } else {
                        replace_pod(&client, &namespace, &mut rng, delay).await
                    };
                    match result {
                        Ok(()) => writes.fetch_add(1, Ordering::Relaxed),
                        Err(kube::Error::Api(e)) if e.code == 409 => {
                            conflicts.fetch_add(1, Ordering::Relaxed)
                        }
                        Err(kube::Error::Api(e)) if e.code == 404 => 0,
                        Err(e) => {
                            eprintln!("chaos: the other writer: {e}");
                            0
                        }
                    };
                }
            })
        };
        Writer {
            last,
            aim,
            writes,
            conflicts,
            _task: task,
        }
    }

    /// Writes to `nodes` from now on.
    fn aim_at(&self, nodes: &[String]) {
        if !nodes.is_empty() {
            *self.aim.lock().unwrap_or_else(|p| p.into_inner()) = nodes.to_vec();
        }
    }

    fn counts(&self) -> (usize, usize) {
        (
            self.writes.load(Ordering::Relaxed),
            self.conflicts.load(Ordering::Relaxed),
        )
    }

    /// Nodes where the writer's last label is not what the node says, or
    /// where a healthy node still carries gpuhealth's cordon.
    async fn lost_updates(&self, fleet: &Fleet) -> Result<Vec<Violation>> {
        let last = self.last.lock().await;
        let timeline = fleet.recorder.since(0);
        let api: Api<Node> = Api::all(fleet.s.client.clone());
        let mut lost = Vec::new();
        for name in &fleet.s.nodes {
            let node = api.get(name).await?;
            if let Some(value) = last.get(name)
                && node.labels().get(LABEL) != Some(value)
            {
                lost.push(Violation::Missing {
                    what: format!(
                        "{name}: the other writer's label {value:?} was lost ({:?})",
                        node.labels().get(LABEL)
                    ),
                });
            }
            let ours = node.annotations().contains_key(CORDONED_BY_ANNOTATION);
            let persons = fleet.foreign_cordons.contains(name);
            if latest_phase(&timeline, name) == Some(Phase::Healthy)
                && ours
                && is_cordoned(&node)
                && !persons
            {
                lost.push(Violation::Missing {
                    what: format!("{name} is Healthy but still cordoned by gpuhealth"),
                });
            }
        }
        Ok(lost)
    }
}

/// Read, change, replace: the label and an annotation of the writer's own.
async fn replace_node(
    client: &Client,
    name: &str,
    value: &str,
    delay: Duration,
) -> kube::Result<()> {
    let api: Api<Node> = Api::all(client.clone());
    let mut node = api.get(name).await?;
    // Someone editing by hand, or a controller with a stale cache: the
    // write lands a while after the read, and whoever wrote meanwhile wins.
    tokio::time::sleep(delay).await;
    node.labels_mut().insert(LABEL.into(), value.into());
    node.annotations_mut()
        .insert(format!("{LABEL}-note"), format!("write {value}"));
    api.replace(name, &PostParams::default(), &node).await?;
    Ok(())
}

/// Read, change, replace: gpuhealth's tolerance annotation on a random pod,
/// between unset and `evict` (the same tolerance).
async fn replace_pod(
    client: &Client,
    namespace: &str,
    rng: &mut Rng,
    delay: Duration,
) -> kube::Result<()> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let pods = api.list(&ListParams::default().labels("app=vllm")).await?;
    if pods.items.is_empty() {
        return Ok(());
    }
    let mut pod = pods.items[rng.below(pods.items.len())].clone();
    let annotations = pod.annotations_mut();
    if annotations
        .remove(DISRUPTION_TOLERANCE_ANNOTATION)
        .is_none()
    {
        annotations.insert(DISRUPTION_TOLERANCE_ANNOTATION.into(), "evict".into());
    }
    tokio::time::sleep(delay).await;
    api.replace(&pod.name_any(), &PostParams::default(), &pod)
        .await?;
    Ok(())
}

/// The operator's writes and the 409s among them, from its `/metrics`.
fn operator_writes(metrics: &str) -> (u64, u64) {
    let (mut writes, mut conflicts) = (0, 0);
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix("gpuhealth_api_requests_total{") else {
            continue;
        };
        let Some((labels, value)) = rest.split_once("} ") else {
            continue;
        };
        let n = value.trim().parse::<f64>().unwrap_or(0.0) as u64;
        let write = ["create", "update", "patch", "delete"]
            .iter()
            .any(|v| labels.contains(&format!("verb=\"{v}\"")));
        if write {
            writes += n;
            if labels.contains("code=\"409\"") {
                conflicts += n;
            }
        }
    }
    (writes, conflicts)
}
