//! The kubelet's PodResources on a simulated node: each pod the API server
//! binds to the node gets the lowest free GPU, as the kubelet's device
//! manager would give it, until the pod goes.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use gpuhealth_agent::pod_resources::proto::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ContainerDevices,
    ContainerResources, ListPodResourcesRequest, ListPodResourcesResponse, PodResources,
    pod_resources_lister_server::PodResourcesLister,
};
use k8s_openapi::api::core::v1::Pod;
use kube::{Api, Client, ResourceExt, api::ListParams};

pub struct Kubelet {
    pub client: Client,
    pub node: String,
    /// The node's GPUs' UUIDs, by index.
    pub gpus: Vec<String>,
    /// Pod UID → the GPU given to it.
    pub given: Arc<Mutex<BTreeMap<String, usize>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[tonic::async_trait]
impl PodResourcesLister for Kubelet {
    async fn list(
        &self,
        _: tonic::Request<ListPodResourcesRequest>,
    ) -> std::result::Result<tonic::Response<ListPodResourcesResponse>, tonic::Status> {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let on_node = pods
            .list(&ListParams::default().fields(&format!("spec.nodeName={}", self.node)))
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        let mut given = lock(&self.given);
        let live: BTreeMap<String, &Pod> = on_node
            .iter()
            .filter(|p| {
                let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
                !matches!(phase, Some("Succeeded" | "Failed"))
            })
            .map(|p| (p.uid().unwrap_or_default(), p))
            .collect();
        given.retain(|uid, _| live.contains_key(uid));
        let mut answer = ListPodResourcesResponse::default();
        for (uid, pod) in &live {
            let wants_gpu = pod.spec.as_ref().is_some_and(|s| {
                s.containers.iter().any(|c| {
                    c.resources
                        .as_ref()
                        .and_then(|r| r.limits.as_ref())
                        .is_some_and(|l| l.contains_key("nvidia.com/gpu"))
                })
            });
            if !wants_gpu {
                continue;
            }
            let gpu = match given.get(uid) {
                Some(gpu) => Some(*gpu),
                None => {
                    let free = (0..self.gpus.len()).find(|g| !given.values().any(|t| t == g));
                    if let Some(g) = free {
                        given.insert(uid.clone(), g);
                    }
                    free
                }
            };
            let Some(gpu) = gpu else { continue };
            let container = pod
                .spec
                .as_ref()
                .and_then(|s| s.containers.first())
                .map(|c| c.name.clone())
                .unwrap_or_default();
            answer.pod_resources.push(PodResources {
                name: pod.name_any(),
                namespace: pod.namespace().unwrap_or_default(),
                containers: vec![ContainerResources {
                    name: container,
                    devices: vec![ContainerDevices {
                        resource_name: "nvidia.com/gpu".into(),
                        device_ids: vec![self.gpus[gpu].clone()],
                    }],
                    dynamic_resources: Vec::new(),
                }],
            });
        }
        Ok(tonic::Response::new(answer))
    }

    /// Every GPU: this stand-in's device plugin withdraws none from the
    /// kubelet (it changes only the Node's allocatable count).
    async fn get_allocatable_resources(
        &self,
        _: tonic::Request<AllocatableResourcesRequest>,
    ) -> std::result::Result<tonic::Response<AllocatableResourcesResponse>, tonic::Status> {
        Ok(tonic::Response::new(AllocatableResourcesResponse {
            devices: vec![ContainerDevices {
                resource_name: "nvidia.com/gpu".into(),
                device_ids: self.gpus.clone(),
            }],
        }))
    }
}
