//! What makes a reconcile run, read from the watches that fill the stores
//! rather than from watches of their own: a second watch of a kind lists
//! the whole fleet again at every start, and at 1,000 nodes the operator
//! kept three lists of health records and two of nodes alive at once
//! (bench/FINDINGS.md).

use std::{
    collections::HashMap,
    sync::{Arc, OnceLock},
};

use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender, unbounded};
use gpuhealth_api::{GpuHealthPolicy, GpuNodeHealth};
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api, ResourceExt,
    runtime::{
        reflector::{ObjectRef, Store},
        watcher::{self, Event},
    },
};

type Watched<K> = Result<Event<K>, watcher::Error>;

/// One item per policy created, deleted or changed in its spec: every
/// node's decision may change. Status writes are left out: the policy's
/// status follows its nodes, and reconciling every node on each of them
/// made a fleet-wide change cost nodes × changes reconciles (the benchmark
/// found it at 1,000 nodes).
pub fn spec_changes(api: Api<GpuHealthPolicy>) -> impl futures::Stream<Item = ()> + Send + 'static {
    use futures::StreamExt;
    use kube::runtime::WatchStreamExt;
    let mut generations: HashMap<String, Option<i64>> = HashMap::new();
    watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .filter_map(move |event| {
            let changed = match event {
                Ok(Event::Apply(p) | Event::InitApply(p)) => {
                    generations.insert(p.name_any(), p.metadata.generation)
                        != Some(p.metadata.generation)
                }
                Ok(Event::Delete(p)) => {
                    generations.remove(&p.name_any());
                    true
                }
                // A relist may have missed a deletion: look at every node again.
                Ok(Event::InitDone) => true,
                Ok(Event::Init) | Err(_) => false,
            };
            futures::future::ready(changed.then_some(()))
        })
}

/// Looks at each node event before `nodes` takes it in, and says when the
/// fleet's labels changed: a node came, went or was relabelled, all that
/// decides which nodes a policy selects. A heartbeat says nothing. After a
/// relist, once: it may have missed a deletion.
pub fn label_changes(
    nodes: Store<Node>,
    changed: UnboundedSender<()>,
) -> impl FnMut(&Watched<Node>) + Send + 'static {
    move |event| {
        let relabelled = match event {
            Ok(Event::Apply(node)) => nodes
                .get(&ObjectRef::from_obj(node))
                .is_none_or(|before| before.labels() != node.labels()),
            Ok(Event::Delete(_) | Event::InitDone) => true,
            Ok(Event::Init | Event::InitApply(_)) | Err(_) => false,
        };
        if relabelled {
            let _ = changed.unbounded_send(());
        }
    }
}

/// Says when a node was deleted, or the watch relisted (which may have
/// missed a deletion): the records of deleted nodes are looked at then.
pub fn deletions(deleted: UnboundedSender<()>) -> impl FnMut(&Watched<Node>) + Send + 'static {
    move |event| {
        if matches!(event, Ok(Event::Delete(_) | Event::InitDone)) {
            let _ = deleted.unbounded_send(());
        }
    }
}

/// Where a change to a health record is sent once this replica leads: its
/// node, and the policy it counts towards. Nowhere before: a standby
/// reconciles nothing, and a new leader looks at every node and policy
/// once anyway, from its stores.
#[derive(Clone, Default)]
pub struct HealthChanges(Arc<OnceLock<Targets>>);

struct Targets {
    nodes: UnboundedSender<ObjectRef<Node>>,
    policies: UnboundedSender<ObjectRef<GpuHealthPolicy>>,
}

/// The changes `HealthChanges::lead` hands over.
pub struct HealthReceivers {
    pub nodes: UnboundedReceiver<ObjectRef<Node>>,
    pub policies: UnboundedReceiver<ObjectRef<GpuHealthPolicy>>,
}

impl HealthChanges {
    /// From now on, changes are sent; None if already leading.
    pub fn lead(&self) -> Option<HealthReceivers> {
        let (nodes, node_changes) = unbounded();
        let (policies, policy_changes) = unbounded();
        self.0.set(Targets { nodes, policies }).ok()?;
        Some(HealthReceivers {
            nodes: node_changes,
            policies: policy_changes,
        })
    }

    /// Looks at each event of the health records' watch.
    pub fn tap(&self) -> impl FnMut(&Watched<GpuNodeHealth>) + Send + 'static {
        let targets = self.0.clone();
        move |event| {
            let (
                Some(targets),
                Ok(Event::Apply(health) | Event::InitApply(health) | Event::Delete(health)),
            ) = (targets.get(), event)
            else {
                return;
            };
            let _ = targets
                .nodes
                .unbounded_send(ObjectRef::new(&health.name_any()));
            // A gang taken down whole opens a window for the nodes it ran
            // on (a repair that waits for a reset is done in it), and
            // closes it: they look again.
            for node in crate::gangs::nodes_of_gangs(health) {
                let _ = targets.nodes.unbounded_send(ObjectRef::new(node));
            }
            if let Some(policy) = health.status.as_ref().and_then(|s| s.policy.as_deref()) {
                let _ = targets.policies.unbounded_send(ObjectRef::new(policy));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use kube::runtime::reflector;

    use super::*;

    fn node(name: &str, labels: &[(&str, &str)]) -> Node {
        let mut node = Node::default();
        node.metadata.name = Some(name.into());
        node.metadata.labels = Some(
            labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        );
        node
    }

    fn sent(rx: &mut UnboundedReceiver<()>) -> usize {
        std::iter::from_fn(|| rx.try_recv().ok()).count()
    }

    #[test]
    fn only_a_new_node_a_relabel_a_deletion_or_a_relist_is_a_label_change() {
        let (store, mut writer) = reflector::store::<Node>();
        let (tx, mut rx) = unbounded();
        let mut tap = label_changes(store, tx);
        let mut see = |event: Event<Node>| {
            tap(&Ok(event.clone()));
            writer.apply_watcher_event(&event);
        };
        see(Event::Init);
        see(Event::InitApply(node("a", &[("pool", "x")])));
        assert_eq!(sent(&mut rx), 0, "a list's nodes are counted at its end");
        see(Event::InitDone);
        assert_eq!(sent(&mut rx), 1);

        let mut heartbeat = node("a", &[("pool", "x")]);
        heartbeat.metadata.resource_version = Some("2".into());
        see(Event::Apply(heartbeat));
        assert_eq!(sent(&mut rx), 0, "same labels: no change");
        see(Event::Apply(node("a", &[("pool", "y")])));
        assert_eq!(sent(&mut rx), 1);
        see(Event::Apply(node("b", &[])));
        assert_eq!(sent(&mut rx), 1, "a new node");
        see(Event::Delete(node("b", &[])));
        assert_eq!(sent(&mut rx), 1);
    }

    #[test]
    fn health_changes_go_to_their_node_and_policy_only_once_leading() {
        let changes = HealthChanges::default();
        let mut tap = changes.tap();
        let mut health = GpuNodeHealth::new("node-a", Default::default());
        health.status = Some(gpuhealth_api::node_health::GpuNodeHealthStatus {
            policy: Some("fleet".into()),
            ..Default::default()
        });
        tap(&Ok(Event::Apply(health.clone())));
        let Some(mut receivers) = changes.lead() else {
            panic!("the first lead hands the receivers over");
        };
        assert!(changes.lead().is_none());
        assert!(
            receivers.nodes.try_recv().is_err(),
            "nothing from before leading"
        );
        tap(&Ok(Event::Apply(health.clone())));
        tap(&Ok(Event::Init));
        assert_eq!(
            receivers.nodes.try_recv().ok(),
            Some(ObjectRef::new("node-a"))
        );
        assert_eq!(
            receivers.policies.try_recv().ok(),
            Some(ObjectRef::new("fleet"))
        );
        assert!(receivers.nodes.try_recv().is_err());
    }
}
