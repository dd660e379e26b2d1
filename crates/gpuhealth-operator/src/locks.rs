//! What other tools hold outside the Node: kured's reboot lock (an
//! annotation on its DaemonSet naming the node) and Medik8s
//! `NodeMaintenance` objects. Read every few seconds for the actors the
//! policies name; a tool that is not installed is simply absent.

use std::{
    collections::BTreeMap,
    sync::{Arc, RwLock},
    time::Duration,
};

use gpuhealth_api::{
    GpuHealthPolicy,
    policy::{OtherActor, SignalSource},
};
use k8s_openapi::api::apps::v1::DaemonSet;
use kube::{
    Api, Client, ResourceExt,
    api::{ApiResource, DynamicObject, GroupVersionKind, ListParams},
    runtime::reflector::Store,
};
use tracing::{debug, warn};

/// How often the locks are read again.
pub const POLL: Duration = Duration::from_secs(5);

/// Per node, the actors (by name) that name it now, and how.
pub type Named = BTreeMap<String, BTreeMap<String, String>>;

#[derive(Default)]
pub struct Locks(RwLock<Named>);

impl Locks {
    /// The actors naming `node`.
    pub fn of(&self, node: &str) -> BTreeMap<String, String> {
        self.0
            .read()
            .map(|m| m.get(node).cloned().unwrap_or_default())
            .unwrap_or_default()
    }
}

/// Reads the locks the policies' actors name, forever.
pub async fn poll(client: Client, policies: Store<GpuHealthPolicy>, locks: Arc<Locks>) {
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
        for OtherActor {
            name,
            source,
            key,
            object,
            ..
        } in actors
        {
            let found = match source {
                SignalSource::KuredLock => kured(&client, &key, object.as_deref()).await,
                _ => node_maintenances(&client, &key).await,
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
                }
            }
        }
        if complete && let Ok(mut m) = locks.0.write() {
            *m = named;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The nodes kured's lock names: one (`"nodeID"`) or several (kured's
/// multi-lock, a list of such entries).
async fn kured(
    client: &Client,
    annotation: &str,
    object: Option<&str>,
) -> Result<Vec<(String, String)>, kube::Error> {
    let (namespace, name) = object
        .unwrap_or("kube-system/kured")
        .split_once('/')
        .unwrap_or(("kube-system", "kured"));
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
    use super::node_ids;

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
}
