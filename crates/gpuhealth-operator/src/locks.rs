//! What other tools hold outside the Node: kured's reboot lock (an
//! annotation on its DaemonSet naming the node) and Medik8s
//! `NodeMaintenance` objects. Read every few seconds for the actors the
//! policies name; a tool that is not installed is simply absent. A lock
//! that cannot be read (the operator may not, or the read fails) is kept
//! for the policies' `Ready` condition to name.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use futures::channel::mpsc::UnboundedSender;
use gpuhealth_api::{
    GpuHealthPolicy,
    policy::{OtherActor, SignalSource},
};
use gpuhealth_engine::others::kured_daemonset;
use k8s_openapi::api::apps::v1::DaemonSet;
use kube::{
    Api, Client, ResourceExt,
    api::{ApiResource, DynamicObject, GroupVersionKind, ListParams},
    runtime::reflector::Store,
};
use parking_lot::RwLock;
use tracing::{debug, warn};

/// How often the locks are read again.
pub const POLL: Duration = Duration::from_secs(5);

/// How many reads in a row must fail before a lock counts as unreadable:
/// one lost read is a blip, not a policy that cannot be honoured.
pub const UNREADABLE_AFTER: u32 = 2;

/// Per node, the actors (by name) that name it now, and how.
pub type Named = BTreeMap<String, BTreeMap<String, String>>;

#[derive(Default)]
pub struct Locks {
    named: RwLock<Named>,
    /// The actors whose lock could not be read the last
    /// [`UNREADABLE_AFTER`] times or more, and why (the first failure's
    /// words, so that a message does not change with every poll).
    unreadable: RwLock<Vec<(OtherActor, String)>>,
    /// Whether a first round of reads has been made (each read then
    /// succeeded or was counted as failing).
    read_once: tokio::sync::watch::Sender<bool>,
}

impl Locks {
    /// The actors naming `node`.
    pub fn of(&self, node: &str) -> BTreeMap<String, String> {
        self.named.read().get(node).cloned().unwrap_or_default()
    }

    /// Resolves once the first round of reads is made: before it, no lock
    /// is known, and a budget would not count a node another tool holds.
    pub async fn read_once(&self) {
        let _ = self.read_once.subscribe().wait_for(|done| *done).await;
    }

    /// Why `actor`'s lock cannot be read, if it cannot.
    pub fn unreadable(&self, actor: &OtherActor) -> Option<String> {
        self.unreadable
            .read()
            .iter()
            .find(|(a, _)| a == actor)
            .map(|(_, why)| why.clone())
    }
}

/// The words of a failed read: the API server's own, with its code, when
/// it answered.
fn why(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) => format!("{} {}: {}", s.code, s.reason, s.message),
        e => e.to_string(),
    }
}

/// Reads the locks the policies' actors name, forever; sends on `changed`
/// whenever the set of unreadable ones changes.
pub async fn poll(
    client: Client,
    policies: Store<GpuHealthPolicy>,
    locks: Arc<Locks>,
    changed: UnboundedSender<()>,
) {
    // Per actor failing now: reads failed in a row, and the first one's words.
    let mut failing: Vec<(OtherActor, u32, String)> = Vec::new();
    loop {
        let mut actors: Vec<OtherActor> = Vec::new();
        for a in policies
            .state()
            .iter()
            .flat_map(|p| p.spec.other_actors.clone())
        {
            let outside = matches!(
                a.source,
                SignalSource::KuredLock | SignalSource::NodeMaintenance
            );
            if outside && !actors.contains(&a) {
                actors.push(a);
            }
        }
        let mut named = Named::new();
        let mut complete = true;
        let mut failed = Vec::new();
        for actor in &actors {
            let OtherActor {
                name,
                source,
                key,
                object,
                ..
            } = actor;
            let found = match source {
                SignalSource::KuredLock => kured(&client, key, object.as_deref()).await,
                _ => node_maintenances(&client, key).await,
            };
            match found {
                Ok(nodes) => {
                    for (node, how) in nodes {
                        named.entry(node).or_default().insert(name.clone(), how);
                    }
                }
                Err(e) => {
                    // Keep what was known: a lost read must not end a hold.
                    warn!(actor = %name, error = %e, "could not read another tool's lock; keeping the last known");
                    complete = false;
                    failed.push((actor.clone(), why(&e)));
                }
            }
        }
        failing = streaks(&failing, failed);
        if complete {
            *locks.named.write() = named;
        }
        let unreadable = unreadable(&failing);
        let news = {
            let mut u = locks.unreadable.write();
            let news = *u != unreadable;
            *u = unreadable;
            news
        };
        if news {
            // The policies' status says it; a closed channel means the
            // controllers have stopped, and so will this.
            let _ = changed.unbounded_send(());
        }
        locks.read_once.send_replace(true);
        tokio::time::sleep(POLL).await;
    }
}

/// Each actor whose read failed now (with why), and how many reads of it
/// have failed in a row, given `before`, the same after the last poll: a
/// read that succeeded ends its actor's streak; the words are the first
/// failure's.
fn streaks(
    before: &[(OtherActor, u32, String)],
    failed: Vec<(OtherActor, String)>,
) -> Vec<(OtherActor, u32, String)> {
    failed
        .into_iter()
        .map(
            |(actor, words)| match before.iter().find(|(a, ..)| *a == actor) {
                Some((_, n, first)) => (actor, n.saturating_add(1), first.clone()),
                None => (actor, 1, words),
            },
        )
        .collect()
}

/// The actors of `streaks` that count as unreadable, and why.
fn unreadable(streaks: &[(OtherActor, u32, String)]) -> Vec<(OtherActor, String)> {
    streaks
        .iter()
        .filter(|(_, n, _)| *n >= UNREADABLE_AFTER)
        .map(|(a, _, words)| (a.clone(), words.clone()))
        .collect()
}

/// The nodes kured's lock names: one (`"nodeID"`) or several (kured's
/// multi-lock, a list of such entries).
async fn kured(
    client: &Client,
    annotation: &str,
    object: Option<&str>,
) -> Result<Vec<(String, String)>, kube::Error> {
    let (namespace, name) = kured_daemonset(object);
    let api: Api<DaemonSet> = Api::namespaced(client.clone(), namespace);
    let Some(ds) = api.get_opt(name).await? else {
        return Ok(Vec::new());
    };
    let Some(value) = ds.annotations().get(annotation) else {
        return Ok(Vec::new());
    };
    let how = format!("reboot lock {annotation} on {namespace}/{name}");
    Ok(node_ids(value)
        .into_iter()
        .map(|n| (n, how.clone()))
        .collect())
}

/// Every `nodeID` string in a JSON value, at any depth.
pub fn node_ids(value: &str) -> Vec<String> {
    fn walk(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("nodeID", serde_json::Value::String(n)) if !n.is_empty() => {
                            out.push(n.clone())
                        }
                        _ => walk(v, out),
                    }
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = Vec::new();
    if let Ok(v) = serde_json::from_str::<serde_json::Value>(value) {
        walk(&v, &mut out);
    }
    out
}

/// The nodes Medik8s `NodeMaintenance` objects name.
async fn node_maintenances(
    client: &Client,
    group: &str,
) -> Result<Vec<(String, String)>, kube::Error> {
    let gvk = GroupVersionKind::gvk(group, "v1beta1", "NodeMaintenance");
    let resource = ApiResource::from_gvk_with_plural(&gvk, "nodemaintenances");
    // Asked first, so that a cluster without Medik8s is not sent a request
    // for an unknown path every poll (the client warns about each 404).
    let installed = client
        .list_api_groups()
        .await?
        .groups
        .iter()
        .any(|g| g.name == group);
    if !installed {
        debug!(%group, "no NodeMaintenance kind in this cluster");
        return Ok(Vec::new());
    }
    let api: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
    let list = match api.list(&ListParams::default()).await {
        Ok(l) => l,
        // Not installed.
        Err(kube::Error::Api(s)) if s.code == 404 => {
            debug!(%group, "no NodeMaintenance kind in this cluster");
            return Ok(Vec::new());
        }
        Err(e) => return Err(e),
    };
    Ok(list
        .items
        .iter()
        .filter_map(|m| {
            let node = m.data.get("spec")?.get("nodeName")?.as_str()?;
            Some((node.to_owned(), format!("NodeMaintenance {}", m.name_any())))
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use gpuhealth_api::policy::default_other_actors;

    use super::{node_ids, streaks, unreadable};

    #[test]
    fn kured_names_one_node_or_several() {
        assert_eq!(
            node_ids(
                r#"{"nodeID":"gpu-7","metadata":{"unschedulable":false},"created":"2026-05-29T08:00:00Z","TTL":0}"#
            ),
            ["gpu-7"]
        );
        assert_eq!(
            node_ids(r#"{"maxOwners":2,"locks":[{"nodeID":"a"},{"nodeID":"b"}]}"#),
            ["a", "b"]
        );
        assert!(node_ids("").is_empty());
        assert!(node_ids(r#"{"nodeID":""}"#).is_empty());
    }

    #[test]
    fn a_lock_is_unreadable_after_reads_fail_in_a_row_and_readable_at_once() {
        let actors = default_other_actors();
        let (kured, medik8s) = (&actors[1], &actors[3]);
        let forbidden =
            |a: &gpuhealth_api::policy::OtherActor, words: &str| (a.clone(), words.into());
        // One failed read is a blip.
        let first = streaks(&[], vec![forbidden(kured, "403 Forbidden: no")]);
        assert!(unreadable(&first).is_empty());
        // Two in a row: unreadable, in the first failure's words.
        let second = streaks(
            &first,
            vec![
                forbidden(kured, "500 InternalError: other words"),
                forbidden(medik8s, "timeout"),
            ],
        );
        assert_eq!(
            unreadable(&second),
            [(kured.clone(), "403 Forbidden: no".into())]
        );
        let third = streaks(
            &second,
            vec![forbidden(kured, "again"), forbidden(medik8s, "timeout")],
        );
        assert_eq!(unreadable(&third).len(), 2);
        // A read that succeeds ends it.
        let read = streaks(&third, vec![forbidden(medik8s, "timeout")]);
        assert_eq!(unreadable(&read), [(medik8s.clone(), "timeout".into())]);
        assert!(unreadable(&streaks(&read, Vec::new())).is_empty());
    }
}
