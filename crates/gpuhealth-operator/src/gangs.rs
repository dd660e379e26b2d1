//! Reading the gangs of a draining node's pods: every member, on whichever
//! node it runs, and the disruption budgets on them. One list of the
//! gang's namespace per gang (narrowed by label where its mark is one),
//! only while a drain may take the gang.

use std::collections::BTreeMap;

use gpuhealth_api::{
    GpuHealthPolicySpec, GpuNodeHealth,
    gang::{GangKey, GangMode},
    node_health::Phase,
};
use gpuhealth_engine::{
    drain::PodView,
    gangs::{GangMember, GangView, GangWindow},
};
use k8s_openapi::api::{core::v1::Pod, policy::v1::PodDisruptionBudget};
use kube::{Api, ResourceExt, api::ListParams};

use crate::{
    context::Context,
    observe::{budget_views, pod_view},
};

/// The gangs of `pods` (the node's) that a drain would act on: those of
/// pods that hold or ask for a GPU and have not finished.
pub async fn read(
    ctx: &Context,
    spec: &GpuHealthPolicySpec,
    pods: &[PodView],
) -> Result<Vec<GangView>, kube::Error> {
    let label = spec.drain.gangs.label_key.as_deref();
    let mut keys: Vec<&GangKey> = Vec::new();
    for pod in pods {
        if let Some(key) = &pod.gang
            && pod.requests_gpu
            && !pod.finished
            && !pod.daemon
            && !keys.contains(&key)
        {
            keys.push(key);
        }
    }
    let mut gangs = Vec::with_capacity(keys.len());
    for key in keys {
        let api: Api<Pod> = Api::namespaced(ctx.client.clone(), &key.namespace);
        let params = match key.label_selector(label) {
            Some(selector) => ListParams::default().labels(&selector),
            None => ListParams::default(),
        };
        let listed = api.list(&params).await?.items;
        let members: Vec<(Option<String>, PodView)> = listed
            .iter()
            .filter(|p| GangKey::of(p, label).as_ref() == Some(key))
            .map(|p| {
                let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
                (node, pod_view(p, &BTreeMap::new(), label))
            })
            .collect();
        let views: Vec<PodView> = members.iter().map(|(_, p)| p.clone()).collect();
        let pdbs: Vec<PodDisruptionBudget> = ctx
            .budgets
            .state()
            .iter()
            .filter(|b| b.namespace().as_deref() == Some(key.namespace.as_str()))
            .map(|b| PodDisruptionBudget::clone(b))
            .collect();
        gangs.push(GangView {
            key: key.clone(),
            budgets: budget_views(&pdbs, &views),
            members: members
                .into_iter()
                .map(|(node, pod)| GangMember { node, pod })
                .collect(),
        });
    }
    Ok(gangs)
}

/// The gangs other nodes' incidents are taking down whole now, from the
/// health records: a `Draining` node's open incident with a gang told.
pub fn windows(records: &[std::sync::Arc<GpuNodeHealth>], this: &str) -> Vec<GangWindow> {
    let mut windows = Vec::new();
    for record in records {
        let node = record.name_any();
        let Some(status) = record.status.as_ref() else {
            continue;
        };
        let Some(incident) = status.history.first() else {
            continue;
        };
        if node == this
            || status.phase != Phase::Draining
            || incident.ended_at.is_some()
            || status.incident.as_deref() != Some(incident.id.as_str())
        {
            continue;
        }
        for gang in &incident.gangs {
            let Some(told) = &gang.evict_at else { continue };
            if gang.mode == GangMode::Whole {
                windows.push(GangWindow {
                    gang: gang.gang.clone(),
                    node: node.clone(),
                    incident: incident.id.clone(),
                    evict_at: told.0,
                    nodes: gang.nodes.clone(),
                });
            }
        }
    }
    windows
}

/// The nodes a health record's open incident names as its gangs' (to look
/// at again when it changes: a window opened or closed for them).
pub fn nodes_of_gangs(record: &GpuNodeHealth) -> impl Iterator<Item = &str> {
    record
        .status
        .as_ref()
        .and_then(|s| s.history.first())
        .filter(|i| {
            i.ended_at.is_none()
                || record
                    .status
                    .as_ref()
                    .is_some_and(|s| s.phase == Phase::Healthy)
        })
        .into_iter()
        .flat_map(|i| &i.gangs)
        .filter(|g| g.mode == GangMode::Whole && g.evict_at.is_some())
        .flat_map(|g| g.nodes.iter().map(String::as_str))
}
