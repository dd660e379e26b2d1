//! A policy change may change every node's decision, so each node is
//! looked at again: a pass over the fleet. Handed to the controller at
//! once, a pass queued thousands of reconciles ahead of a fault that came
//! during it (1 to 2 s at 5,000 nodes, bench/FINDINGS.md). It is handed
//! over a batch at a time instead, the next batch only once the
//! reconciles in flight leave room, so that a node with news (its report,
//! its health record) waits behind one batch at most.

use std::{
    collections::VecDeque,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::Duration,
};

use futures::{
    Stream, StreamExt,
    channel::mpsc::{UnboundedReceiver, unbounded},
};
use k8s_openapi::api::core::v1::Node;
use kube::runtime::reflector::{ObjectRef, Store};

/// Nodes handed over at a time.
const BATCH: usize = 8;
/// A batch is handed over while fewer reconciles than this are in flight.
const ROOM: usize = 8;
/// How often the room is looked at while a pass is under way.
const TICK: Duration = Duration::from_millis(2);

/// Reconciles in flight now.
#[derive(Default)]
pub struct InFlight(AtomicUsize);

impl InFlight {
    /// Counts a reconcile until the guard is dropped.
    pub fn start(&self) -> Running<'_> {
        self.0.fetch_add(1, Ordering::Relaxed);
        Running(self)
    }

    fn now(&self) -> usize {
        self.0.load(Ordering::Relaxed)
    }
}

pub struct Running<'a>(&'a InFlight);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Every node of `nodes`, once per item of `changes`, paced by `in_flight`.
/// A change during a pass starts it over: the newest spec is the one that
/// counts.
pub fn paced(
    changes: impl Stream<Item = ()> + Send + 'static,
    nodes: Store<Node>,
    in_flight: Arc<InFlight>,
) -> UnboundedReceiver<ObjectRef<Node>> {
    let (out, passes) = unbounded();
    let every_node = move || -> VecDeque<ObjectRef<Node>> {
        nodes
            .state()
            .iter()
            .map(|n| ObjectRef::from_obj(&**n))
            .collect()
    };
    tokio::spawn(async move {
        let mut changes = std::pin::pin!(changes);
        let mut left: VecDeque<ObjectRef<Node>> = VecDeque::new();
        loop {
            if left.is_empty() {
                match changes.next().await {
                    Some(()) => left = every_node(),
                    None => return,
                }
                continue;
            }
            tokio::select! {
                change = changes.next() => match change {
                    Some(()) => left = every_node(),
                    None => return,
                },
                () = tokio::time::sleep(TICK) => {
                    let room = ROOM.saturating_sub(in_flight.now()).min(BATCH);
                    for node in left.drain(..room.min(left.len())) {
                        if out.unbounded_send(node).is_err() {
                            return;
                        }
                    }
                }
            }
        }
    });
    passes
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use kube::runtime::{reflector, watcher::Event};
    use serde_json::json;

    use super::*;

    fn fleet(n: usize) -> Store<Node> {
        let (store, mut writer) = reflector::store();
        for i in 0..n {
            let node: Node =
                serde_json::from_value(json!({"metadata": {"name": format!("gpu-{i}")}}))
                    .expect("node");
            writer.apply_watcher_event(&Event::Apply(node));
        }
        store
    }

    /// How many nodes `passes` hands over within `within`, up to `want`.
    async fn handed(
        passes: &mut UnboundedReceiver<ObjectRef<Node>>,
        want: usize,
        within: Duration,
    ) -> usize {
        let deadline = Instant::now() + within;
        let mut n = 0;
        while n < want
            && let Ok(Some(_)) = tokio::time::timeout(
                deadline.saturating_duration_since(Instant::now()),
                passes.next(),
            )
            .await
        {
            n += 1;
        }
        n
    }

    #[tokio::test]
    async fn a_pass_waits_while_the_reconciles_in_flight_leave_no_room() {
        let in_flight = Arc::new(InFlight::default());
        let busy: Vec<Running<'_>> = (0..ROOM).map(|_| in_flight.start()).collect();
        let (change, changes) = unbounded();
        let mut passes = paced(changes, fleet(100), in_flight.clone());
        change.unbounded_send(()).expect("sent");
        assert_eq!(handed(&mut passes, 1, Duration::from_millis(50)).await, 0);
        drop(busy);
        assert_eq!(
            handed(&mut passes, 100, Duration::from_secs(1)).await,
            100,
            "every node, once room is made"
        );
        assert_eq!(
            handed(&mut passes, 1, Duration::from_millis(20)).await,
            0,
            "once"
        );
    }

    #[tokio::test]
    async fn a_pass_hands_over_at_most_the_room_left() {
        let in_flight = Arc::new(InFlight::default());
        let (change, changes) = unbounded();
        let mut passes = paced(changes, fleet(100), in_flight.clone());
        // Reconciles that never end: each node handed over stays in flight.
        let mut running = Vec::new();
        change.unbounded_send(()).expect("sent");
        let deadline = Instant::now() + Duration::from_millis(100);
        while let Ok(Some(_)) = tokio::time::timeout(
            deadline.saturating_duration_since(Instant::now()),
            passes.next(),
        )
        .await
        {
            running.push(in_flight.start());
        }
        assert_eq!(running.len(), ROOM, "no more than the room");
    }

    #[tokio::test]
    async fn a_change_during_a_pass_starts_it_over() {
        let in_flight = Arc::new(InFlight::default());
        let (change, changes) = unbounded();
        let mut passes = paced(changes, fleet(20), in_flight.clone());
        change.unbounded_send(()).expect("sent");
        change.unbounded_send(()).expect("sent");
        let n = handed(&mut passes, 41, Duration::from_millis(500)).await;
        assert!((20..=40).contains(&n), "{n}");
    }
}
