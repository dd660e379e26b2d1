//! What makes a reconcile run, read from the watches that fill the stores
//! rather than from watches of their own: a second watch of a kind lists
//! the whole fleet again at every start, and at 1,000 nodes the operator
//! kept three lists of health records and two of nodes alive at once
//! (bench/FINDINGS.md).

use std::{
    collections::HashMap,
    sync::{
        Arc, OnceLock,
        atomic::{AtomicBool, Ordering},
    },
};

use futures::channel::mpsc::{UnboundedReceiver, UnboundedSender, unbounded};
use gpuhealth_api::{GpuHealthPolicy, GpuNodeHealth};
use k8s_openapi::api::core::v1::Node;
use kube::{
    ResourceExt,
    runtime::{
        reflector::{ObjectRef, Store},
        watcher::{self, Event},
    },
};

type Watched<K> = Result<Event<K>, watcher::Error>;

/// One item per policy created, deleted or changed in its spec, once this
/// replica leads, for the nodes and for the policies: every node's
/// decision may change, and every policy's share of the fleet. Status
/// writes are left out: the policy's status follows its nodes, and
/// reconciling every node on each of them made a fleet-wide change cost
/// nodes × changes reconciles (the benchmark found it at 1,000 nodes).
///
/// Read from the policies' store, after it has taken the event in: the
/// reconciles a change starts read the spec there. A watch of its own
/// could deliver the change first, and a node then decided on the old
/// spec with nothing to make it look again (a policy acknowledged past a
/// guardrail stayed held).
#[derive(Clone, Default)]
pub struct SpecChanges(Arc<OnceLock<[UnboundedSender<()>; 2]>>);

/// The changes `SpecChanges::lead` hands over.
pub struct SpecReceivers {
    pub nodes: UnboundedReceiver<()>,
    pub policies: UnboundedReceiver<()>,
}

impl SpecChanges {
    /// From now on, changes are sent; None if already leading.
    pub fn lead(&self) -> Option<SpecReceivers> {
        let (nodes, node_changes) = unbounded();
        let (policies, policy_changes) = unbounded();
        self.0.set([nodes, policies]).ok()?;
        Some(SpecReceivers {
            nodes: node_changes,
            policies: policy_changes,
        })
    }

    /// Looks at each event of the policies' watch once `policies` has
    /// taken it in.
    pub fn tap(
        &self,
        policies: Store<GpuHealthPolicy>,
    ) -> impl FnMut(&Watched<GpuHealthPolicy>) + Send + 'static {
        let target = self.0.clone();
        let mut generations: HashMap<String, Option<i64>> = HashMap::new();
        move |event| {
            let changed = match event {
                // What the store now holds: the spec a reconcile will read.
                Ok(Event::Apply(p)) => {
                    let stored = policies
                        .get(&ObjectRef::from_obj(p))
                        .and_then(|p| p.metadata.generation);
                    stored.is_some() && generations.insert(p.name_any(), stored) != Some(stored)
                }
                // A list is taken in whole at its end, which says so.
                Ok(Event::InitApply(p)) => {
                    generations.insert(p.name_any(), p.metadata.generation);
                    false
                }
                Ok(Event::Delete(p)) => {
                    generations.remove(&p.name_any());
                    true
                }
                // A relist may have missed a deletion: look at every node again.
                Ok(Event::InitDone) => true,
                Ok(Event::Init) | Err(_) => false,
            };
            if let (true, Some(targets)) = (changed, target.get()) {
                for target in targets {
                    let _ = target.unbounded_send(());
                }
            }
        }
    }
}

/// Says when the fleet's labels changed: a node came, went or was
/// relabelled, all that decides which nodes a policy selects. A heartbeat
/// says nothing. After a relist, once: it may have missed a deletion.
///
/// Two looks at each node event: the first, before `nodes` takes it in,
/// compares the labels with the node's before; the second, after, sends,
/// so that the policies' reconciles it starts count the new labels.
pub fn label_changes(
    nodes: Store<Node>,
    changed: UnboundedSender<()>,
) -> (
    impl FnMut(&Watched<Node>) + Send + 'static,
    impl FnMut(&Watched<Node>) + Send + 'static,
) {
    let pending = Arc::new(AtomicBool::new(false));
    let seen = pending.clone();
    let before = move |event: &Watched<Node>| {
        let relabelled = match event {
            Ok(Event::Apply(node)) => nodes
                .get(&ObjectRef::from_obj(node))
                .is_none_or(|before| before.labels() != node.labels()),
            Ok(Event::Delete(_) | Event::InitDone) => true,
            Ok(Event::Init | Event::InitApply(_)) | Err(_) => false,
        };
        if relabelled {
            seen.store(true, Ordering::Relaxed);
        }
    };
    let after = move |_: &Watched<Node>| {
        if pending.swap(false, Ordering::Relaxed) {
            let _ = changed.unbounded_send(());
        }
    };
    (before, after)
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
        let (mut before, mut after) = label_changes(store, tx);
        // As the nodes' watch runs: a look, the store, a look.
        let mut see = |event: Event<Node>| {
            before(&Ok(event.clone()));
            assert_eq!(sent(&mut rx), 0, "nothing sent before the store has it");
            writer.apply_watcher_event(&event);
            after(&Ok(event));
            sent(&mut rx)
        };
        assert_eq!(see(Event::Init), 0);
        assert_eq!(
            see(Event::InitApply(node("a", &[("pool", "x")]))),
            0,
            "a list's nodes are counted at its end"
        );
        assert_eq!(see(Event::InitDone), 1);

        let mut heartbeat = node("a", &[("pool", "x")]);
        heartbeat.metadata.resource_version = Some("2".into());
        assert_eq!(see(Event::Apply(heartbeat)), 0, "same labels: no change");
        assert_eq!(see(Event::Apply(node("a", &[("pool", "y")]))), 1);
        assert_eq!(see(Event::Apply(node("b", &[]))), 1, "a new node");
        assert_eq!(see(Event::Delete(node("b", &[]))), 1);
    }

    /// Sent to the nodes, and to the policies.
    fn both(rx: &mut SpecReceivers) -> (usize, usize) {
        (sent(&mut rx.nodes), sent(&mut rx.policies))
    }

    fn policy(name: &str, generation: i64) -> GpuHealthPolicy {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "gpuhealth.io/v1alpha1",
            "kind": "GpuHealthPolicy",
            "metadata": {"name": name, "generation": generation},
            "spec": {"nodeSelector": {}},
        }))
        .expect("policy")
    }

    #[test]
    fn a_spec_change_is_sent_once_leading_and_once_the_store_holds_it() {
        let (store, mut writer) = reflector::store::<GpuHealthPolicy>();
        let changes = SpecChanges::default();
        let mut tap = changes.tap(store);
        // As the policies' watch runs: the store first, then the tap.
        let mut see = |event: Event<GpuHealthPolicy>| {
            writer.apply_watcher_event(&event);
            tap(&Ok(event));
        };
        see(Event::Init);
        see(Event::InitApply(policy("fleet", 1)));
        see(Event::InitDone);
        see(Event::Apply(policy("fleet", 2)));
        let Some(mut rx) = changes.lead() else {
            panic!("the first lead hands the receiver over");
        };
        assert!(changes.lead().is_none());
        assert_eq!(both(&mut rx), (0, 0), "nothing from before leading");

        see(Event::Apply(policy("fleet", 2)));
        assert_eq!(both(&mut rx), (0, 0), "a status write: same generation");
        see(Event::Apply(policy("fleet", 3)));
        assert_eq!(both(&mut rx), (1, 1), "a spec change");
        see(Event::Apply(policy("canary", 1)));
        assert_eq!(both(&mut rx), (1, 1), "a new policy");
        see(Event::Delete(policy("canary", 1)));
        assert_eq!(both(&mut rx), (1, 1), "a deleted one");
        see(Event::Init);
        see(Event::InitApply(policy("fleet", 3)));
        assert_eq!(
            both(&mut rx),
            (0, 0),
            "a list's policies are counted at its end"
        );
        see(Event::InitDone);
        assert_eq!(both(&mut rx), (1, 1), "a relist");
    }

    #[test]
    fn a_spec_change_the_store_has_not_taken_in_is_not_sent() {
        // Tapped before the store: the reconciles it would start would
        // read the old spec, so the change must not be taken as seen.
        let (store, mut writer) = reflector::store::<GpuHealthPolicy>();
        let changes = SpecChanges::default();
        let mut tap = changes.tap(store);
        let Some(mut rx) = changes.lead() else {
            panic!("leading");
        };
        writer.apply_watcher_event(&Event::Apply(policy("fleet", 1)));
        tap(&Ok(Event::Apply(policy("fleet", 1))));
        assert_eq!(sent(&mut rx.nodes), 1);
        tap(&Ok(Event::Apply(policy("fleet", 2))));
        assert_eq!(sent(&mut rx.nodes), 0, "the store still holds generation 1");
        writer.apply_watcher_event(&Event::Apply(policy("fleet", 2)));
        tap(&Ok(Event::Apply(policy("fleet", 2))));
        assert_eq!(sent(&mut rx.nodes), 1, "now it does");
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
