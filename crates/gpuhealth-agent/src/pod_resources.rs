//! Which pod holds which GPU, from the kubelet's PodResources API (`List`,
//! gRPC over its unix socket). The device ids the NVIDIA device plugin
//! hands out are GPU UUIDs; time-slicing adds `::N`, which is stripped.

use std::{collections::BTreeMap, path::Path};

use gpuhealth_api::contract::PodRef;
use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

pub mod proto {
    tonic::include_proto!("v1");
}

use proto::{
    ListPodResourcesRequest, ListPodResourcesResponse,
    pod_resources_lister_client::PodResourcesListerClient,
};

/// The resource the NVIDIA device plugin advertises.
pub const GPU_RESOURCE: &str = "nvidia.com/gpu";

#[derive(Debug, thiserror::Error)]
pub enum PodResourcesError {
    #[error("connecting to the kubelet's PodResources socket {path}: {source}")]
    Connect {
        path: String,
        source: tonic::transport::Error,
    },
    #[error("PodResources List: {0}")]
    List(#[from] tonic::Status),
}

/// GPU UUID → the pods (and containers) holding it, sorted.
pub fn gpu_holders(response: &ListPodResourcesResponse) -> BTreeMap<String, Vec<PodRef>> {
    let mut holders: BTreeMap<String, Vec<PodRef>> = BTreeMap::new();
    for pod in &response.pod_resources {
        for container in &pod.containers {
            for devices in container
                .devices
                .iter()
                .filter(|d| d.resource_name == GPU_RESOURCE)
            {
                for id in &devices.device_ids {
                    let uuid = id.split("::").next().unwrap_or(id);
                    let holder = PodRef {
                        namespace: pod.namespace.clone(),
                        name: pod.name.clone(),
                        container: Some(container.name.clone()),
                    };
                    let list = holders.entry(uuid.to_owned()).or_default();
                    if !list.contains(&holder) {
                        list.push(holder);
                    }
                }
            }
        }
    }
    for list in holders.values_mut() {
        list.sort_by(|a, b| {
            (&a.namespace, &a.name, &a.container).cmp(&(&b.namespace, &b.name, &b.container))
        });
    }
    holders
}

/// Asks the kubelet at `socket` who holds which GPU.
pub async fn list(socket: &Path) -> Result<BTreeMap<String, Vec<PodRef>>, PodResourcesError> {
    let path = socket.to_path_buf();
    // The URI is required by the API and ignored: the connector dials the socket.
    let channel: Channel = Endpoint::from_static("http://kubelet.invalid")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move {
                tokio::net::UnixStream::connect(path)
                    .await
                    .map(TokioIo::new)
            }
        }))
        .await
        .map_err(|source| PodResourcesError::Connect {
            path: socket.display().to_string(),
            source,
        })?;
    let response = PodResourcesListerClient::new(channel)
        .list(ListPodResourcesRequest {})
        .await?
        .into_inner();
    Ok(gpu_holders(&response))
}

#[cfg(test)]
mod tests {
    use tokio_stream::wrappers::UnixListenerStream;
    use tonic::{Request, Response, Status};

    use super::{
        proto::{
            ContainerDevices, ContainerResources, PodResources,
            pod_resources_lister_server::{PodResourcesLister, PodResourcesListerServer},
        },
        *,
    };

    fn devices(resource: &str, ids: &[&str]) -> ContainerDevices {
        ContainerDevices {
            resource_name: resource.into(),
            device_ids: ids.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    /// What a kubelet with the NVIDIA device plugin answers on the incident node.
    fn incident() -> ListPodResourcesResponse {
        let vllm = |i: usize| PodResources {
            name: format!("vllm-{i}"),
            namespace: "ml-serving".into(),
            containers: vec![ContainerResources {
                name: "server".into(),
                devices: vec![
                    devices(
                        GPU_RESOURCE,
                        &[&format!("GPU-0a1b2c3d-0000-4000-8000-00000000000{i}")],
                    ),
                    devices("example.com/nic", &["nic-0"]),
                ],
            }],
        };
        let mut pods: Vec<PodResources> = (0..8).map(vllm).collect();
        // Time-slicing: two pods share GPU 0 as GPU-…::0 and GPU-…::1.
        pods.push(PodResources {
            name: "notebook".into(),
            namespace: "research".into(),
            containers: vec![ContainerResources {
                name: "jupyter".into(),
                devices: vec![devices(
                    GPU_RESOURCE,
                    &["GPU-0a1b2c3d-0000-4000-8000-000000000000::1"],
                )],
            }],
        });
        ListPodResourcesResponse {
            pod_resources: pods,
        }
    }

    #[test]
    fn each_gpu_maps_to_its_pods_by_uuid() {
        let holders = gpu_holders(&incident());
        assert_eq!(holders.len(), 8, "only nvidia.com/gpu devices count");
        let gpu7 = &holders["GPU-0a1b2c3d-0000-4000-8000-000000000007"];
        assert_eq!(gpu7.len(), 1);
        assert_eq!(
            (
                gpu7[0].namespace.as_str(),
                gpu7[0].name.as_str(),
                gpu7[0].container.as_deref()
            ),
            ("ml-serving", "vllm-7", Some("server"))
        );
        let shared: Vec<&str> = holders["GPU-0a1b2c3d-0000-4000-8000-000000000000"]
            .iter()
            .map(|p| p.name.as_str())
            .collect();
        // Sorted by namespace, then name.
        assert_eq!(shared, ["vllm-0", "notebook"]);
    }

    struct Kubelet;

    #[tonic::async_trait]
    impl PodResourcesLister for Kubelet {
        async fn list(
            &self,
            _: Request<ListPodResourcesRequest>,
        ) -> Result<Response<ListPodResourcesResponse>, Status> {
            Ok(Response::new(incident()))
        }
    }

    #[tokio::test]
    async fn the_list_comes_over_a_real_grpc_unix_socket() {
        let dir =
            std::env::temp_dir().join(format!("gpuhealth-podresources-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let socket = dir.join("kubelet.sock");
        let listener = tokio::net::UnixListener::bind(&socket).expect("bind");
        let server = tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(PodResourcesListerServer::new(Kubelet))
                .serve_with_incoming(UnixListenerStream::new(listener)),
        );
        let holders = list(&socket).await.expect("List over the socket");
        assert_eq!(holders, gpu_holders(&incident()));
        server.abort();

        let missing = list(&dir.join("absent.sock")).await.expect_err("an error");
        assert!(missing.to_string().contains("absent.sock"), "{missing}");
    }
}
