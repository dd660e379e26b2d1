//! Which pod holds which GPU, from the kubelet's PodResources API (`List`,
//! gRPC over its unix socket), for every way a GPU is handed out:
//!
//! - NVIDIA's device plugin, resource `nvidia.com/gpu` (or a renamed or
//!   shared one such as `nvidia.com/gpu.shared`), device ids that are GPU
//!   UUIDs (`GPU-…`) or, with the `index` id strategy, NVML indexes (`3`);
//!   time-slicing adds `::N`, which is stripped;
//! - MIG slices, `nvidia.com/mig-<profile>` (or `nvidia.com/gpu` with the
//!   single strategy): MIG UUIDs (`MIG-…`) or `<gpu index>:<MIG slot>`;
//! - Dynamic Resource Allocation: a claim's devices by driver, pool and
//!   device name, placed through the `uuid` attribute their ResourceSlice
//!   gives them.
//!
//! A device that names no GPU of the node is never dropped quietly: every
//! GPU's pods are then marked as not fully known.
//!
//! `GetAllocatableResources` says which device-plugin devices the kubelet
//! offers to new pods (those its plugin last reported healthy): a GPU the
//! kubelet still offers is not fenced by its plugin, whatever the node's
//! allocatable count says.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

use gpuhealth_api::contract::PodRef;
use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

use crate::nvml::DeviceReading;

pub mod proto {
    tonic::include_proto!("v1");
}

use proto::{
    AllocatableResourcesRequest, AllocatableResourcesResponse, ListPodResourcesRequest,
    ListPodResourcesResponse, pod_resources_lister_client::PodResourcesListerClient,
};

/// The prefix of the resources NVIDIA's device plugin advertises.
pub const NVIDIA_RESOURCES: &str = "nvidia.com/";
/// NVIDIA's DRA driver for GPUs.
pub const NVIDIA_DRA_DRIVER: &str = "gpu.nvidia.com";

#[derive(Debug, thiserror::Error)]
pub enum PodResourcesError {
    #[error("connecting to the kubelet's PodResources socket {path}: {source}")]
    Connect {
        path: String,
        source: tonic::transport::Error,
    },
    #[error("PodResources: {0}")]
    Call(#[from] tonic::Status),
    #[error("the kubelet's PodResources did not answer within {0:?}")]
    Timeout(std::time::Duration),
}

/// A DRA device, as the kubelet names it: driver, pool, device.
pub type DraDevice = (String, String, String);

/// What places a device id on a GPU of this node.
#[derive(Debug, Default)]
pub struct Placement {
    /// GPU UUID, and MIG UUID → its GPU's UUID.
    by_uuid: BTreeMap<String, String>,
    /// NVML index → GPU UUID.
    by_index: BTreeMap<u32, String>,
    /// (GPU index, MIG slot) → GPU UUID.
    by_mig_slot: BTreeMap<(u32, u32), String>,
    /// DRA devices in this node's ResourceSlices → the UUID they carry, if any.
    dra: BTreeMap<DraDevice, Option<String>>,
}

impl Placement {
    pub fn new(readings: &[DeviceReading], dra: BTreeMap<DraDevice, Option<String>>) -> Placement {
        let mut p = Placement {
            dra,
            ..Default::default()
        };
        for r in readings.iter().filter(|r| !r.uuid.is_empty()) {
            p.by_uuid.insert(r.uuid.clone(), r.uuid.clone());
            p.by_index.insert(r.index, r.uuid.clone());
            for m in &r.mig_devices {
                p.by_uuid.insert(m.uuid.clone(), r.uuid.clone());
                p.by_mig_slot.insert((r.index, m.slot), r.uuid.clone());
            }
        }
        p
    }

    /// The GPU a device plugin's device id names.
    fn plugin_device(&self, id: &str) -> Option<&String> {
        let id = id.split("::").next().unwrap_or(id);
        if let Some(uuid) = self.by_uuid.get(id) {
            return Some(uuid);
        }
        match id.split_once(':') {
            Some((gpu, slot)) => self
                .by_mig_slot
                .get(&(gpu.parse().ok()?, slot.parse().ok()?)),
            None => self.by_index.get(&id.parse().ok()?),
        }
    }

    /// The GPU a DRA device is, if its ResourceSlice says.
    fn dra_device(&self, device: &DraDevice) -> Option<&String> {
        let uuid = self.dra.get(device)?.as_ref()?;
        self.by_uuid.get(uuid)
    }
}

/// Who holds which GPU, and what could not be placed.
#[derive(Debug, Default, PartialEq)]
pub struct Holders {
    /// GPU UUID → the pods (and containers) holding it, sorted.
    pub by_gpu: BTreeMap<String, Vec<PodRef>>,
    /// Devices held by pods that name no GPU of this node, said plainly.
    pub unplaced: Vec<String>,
}

impl Holders {
    /// Why the holders of any GPU are not fully known, if they are not.
    pub fn unknown(&self) -> Option<String> {
        let first = self.unplaced.first()?;
        let more = self.unplaced.len() - 1;
        Some(if more == 0 {
            format!("{first}: which GPU it is cannot be told")
        } else {
            format!("{first} and {more} more device(s): which GPUs they are cannot be told")
        })
    }
}

/// Whether `response` holds a DRA device not in the ResourceSlices read so
/// far (the agent then reads them again).
pub fn unplaced_dra(response: &ListPodResourcesResponse, placement: &Placement) -> bool {
    dra_devices(response).any(|d| !placement.dra.contains_key(&d))
}

fn dra_devices(response: &ListPodResourcesResponse) -> impl Iterator<Item = DraDevice> + '_ {
    response
        .pod_resources
        .iter()
        .flat_map(|p| &p.containers)
        .flat_map(|c| &c.dynamic_resources)
        .flat_map(|d| &d.claim_resources)
        .map(|r| {
            (
                r.driver_name.clone(),
                r.pool_name.clone(),
                r.device_name.clone(),
            )
        })
}

pub fn gpu_holders(response: &ListPodResourcesResponse, placement: &Placement) -> Holders {
    let mut h = Holders::default();
    for pod in &response.pod_resources {
        for container in &pod.containers {
            let holder = PodRef {
                namespace: pod.namespace.clone(),
                name: pod.name.clone(),
                container: Some(container.name.clone()),
            };
            let who = format!("pod {}/{}", pod.namespace, pod.name);
            for devices in container
                .devices
                .iter()
                .filter(|d| d.resource_name.starts_with(NVIDIA_RESOURCES))
            {
                for id in &devices.device_ids {
                    match placement.plugin_device(id) {
                        Some(gpu) => h.add(gpu, &holder),
                        None => h.unplaced.push(format!(
                            "{who} holds {} device {id:?}",
                            devices.resource_name
                        )),
                    }
                }
            }
            for claim in &container.dynamic_resources {
                for r in &claim.claim_resources {
                    let device = (
                        r.driver_name.clone(),
                        r.pool_name.clone(),
                        r.device_name.clone(),
                    );
                    match placement.dra_device(&device) {
                        Some(gpu) => h.add(gpu, &holder),
                        // Another driver's device with no UUID (a NIC, say) is no GPU.
                        None if r.driver_name != NVIDIA_DRA_DRIVER
                            && placement.dra.get(&device).is_none_or(Option::is_none) => {}
                        None => h.unplaced.push(format!(
                            "{who} holds DRA device {}/{}/{} (claim {}/{})",
                            r.driver_name,
                            r.pool_name,
                            r.device_name,
                            claim.claim_namespace,
                            claim.claim_name
                        )),
                    }
                }
            }
        }
    }
    for list in h.by_gpu.values_mut() {
        list.sort_by(|a, b| {
            (&a.namespace, &a.name, &a.container).cmp(&(&b.namespace, &b.name, &b.container))
        });
    }
    h
}

impl Holders {
    fn add(&mut self, gpu: &str, holder: &PodRef) {
        let list = self.by_gpu.entry(gpu.to_owned()).or_default();
        if !list.contains(holder) {
            list.push(holder.clone());
        }
    }
}

/// The node's GPUs (UUIDs) of which the kubelet offers a device-plugin
/// device (the GPU, or a MIG slice of it) to new pods; None when no
/// NVIDIA device plugin offers any GPU of the node (a DRA node).
pub fn offered_gpus(
    allocatable: &AllocatableResourcesResponse,
    placement: &Placement,
) -> Option<BTreeSet<String>> {
    let nvidia: Vec<&proto::ContainerDevices> = allocatable
        .devices
        .iter()
        .filter(|d| d.resource_name.starts_with(NVIDIA_RESOURCES))
        .collect();
    if nvidia.is_empty() {
        return None;
    }
    Some(
        nvidia
            .iter()
            .flat_map(|d| &d.device_ids)
            .filter_map(|id| placement.plugin_device(id).cloned())
            .collect(),
    )
}

/// Asks the kubelet at `socket` which pod holds which device, within `deadline`.
pub async fn list(
    socket: &Path,
    deadline: std::time::Duration,
) -> Result<ListPodResourcesResponse, PodResourcesError> {
    let call = async {
        let mut client = connect(socket).await?;
        Ok(client.list(ListPodResourcesRequest {}).await?.into_inner())
    };
    tokio::time::timeout(deadline, call)
        .await
        .map_err(|_| PodResourcesError::Timeout(deadline))?
}

/// Asks the kubelet at `socket` which device-plugin devices it offers to
/// new pods, within `deadline`.
pub async fn allocatable(
    socket: &Path,
    deadline: std::time::Duration,
) -> Result<AllocatableResourcesResponse, PodResourcesError> {
    let call = async {
        let mut client = connect(socket).await?;
        Ok(client
            .get_allocatable_resources(AllocatableResourcesRequest {})
            .await?
            .into_inner())
    };
    tokio::time::timeout(deadline, call)
        .await
        .map_err(|_| PodResourcesError::Timeout(deadline))?
}

async fn connect(socket: &Path) -> Result<PodResourcesListerClient<Channel>, PodResourcesError> {
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
    Ok(PodResourcesListerClient::new(channel))
}

#[cfg(test)]
mod tests {
    use tokio_stream::wrappers::UnixListenerStream;
    use tonic::{Request, Response, Status};

    use super::{
        proto::{
            ClaimResource, ContainerDevices, ContainerResources, DynamicResource, PodResources,
            pod_resources_lister_server::{PodResourcesLister, PodResourcesListerServer},
        },
        *,
    };
    use crate::nvml::MigDevice;

    fn uuid(i: u32) -> String {
        format!("GPU-0a1b2c3d-0000-4000-8000-00000000000{i}")
    }

    /// Eight GPUs; GPU 6 is split into two MIG slices (slots 0 and 2).
    fn readings() -> Vec<DeviceReading> {
        (0..8)
            .map(|i| DeviceReading {
                index: i,
                uuid: uuid(i),
                mig_devices: if i == 6 {
                    vec![
                        MigDevice {
                            slot: 0,
                            uuid: "MIG-11111111-2222-4333-8444-555555555550".into(),
                        },
                        MigDevice {
                            slot: 2,
                            uuid: "MIG-11111111-2222-4333-8444-555555555552".into(),
                        },
                    ]
                } else {
                    Vec::new()
                },
                ..Default::default()
            })
            .collect()
    }

    fn devices(resource: &str, ids: &[&str]) -> ContainerDevices {
        ContainerDevices {
            resource_name: resource.into(),
            device_ids: ids.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    fn pod(name: &str, devices: Vec<ContainerDevices>, dra: Vec<DynamicResource>) -> PodResources {
        PodResources {
            name: name.into(),
            namespace: "ml".into(),
            containers: vec![ContainerResources {
                name: "main".into(),
                devices,
                dynamic_resources: dra,
            }],
        }
    }

    fn claim(device: &str, driver: &str) -> DynamicResource {
        DynamicResource {
            claim_name: format!("{device}-claim"),
            claim_namespace: "ml".into(),
            claim_resources: vec![ClaimResource {
                driver_name: driver.into(),
                pool_name: "node-1".into(),
                device_name: device.into(),
            }],
        }
    }

    /// One pod per way a GPU is handed out.
    fn every_way() -> ListPodResourcesResponse {
        let uuid0 = uuid(0);
        ListPodResourcesResponse {
            pod_resources: vec![
                pod(
                    "by-uuid",
                    vec![
                        devices("nvidia.com/gpu", &[&uuid0]),
                        devices("example.com/nic", &["nic-0"]),
                    ],
                    vec![],
                ),
                pod(
                    "time-sliced",
                    vec![devices("nvidia.com/gpu.shared", &[&format!("{uuid0}::1")])],
                    vec![],
                ),
                pod(
                    "by-index",
                    vec![devices("nvidia.com/gpu", &["3", "4::2"])],
                    vec![],
                ),
                pod(
                    "mig-by-uuid",
                    vec![devices(
                        "nvidia.com/mig-1g.18gb",
                        &["MIG-11111111-2222-4333-8444-555555555552"],
                    )],
                    vec![],
                ),
                pod(
                    "mig-by-index",
                    vec![devices("nvidia.com/mig-1g.18gb", &["6:0"])],
                    vec![],
                ),
                pod(
                    "dra",
                    vec![],
                    vec![
                        claim("gpu-5", NVIDIA_DRA_DRIVER),
                        claim("nic-1", "nic.example.com"),
                    ],
                ),
            ],
        }
    }

    fn dra_slices() -> BTreeMap<DraDevice, Option<String>> {
        BTreeMap::from([
            (
                (NVIDIA_DRA_DRIVER.into(), "node-1".into(), "gpu-5".into()),
                Some(uuid(5)),
            ),
            (
                ("nic.example.com".into(), "node-1".into(), "nic-1".into()),
                None,
            ),
        ])
    }

    fn names(h: &Holders, gpu: u32) -> Vec<String> {
        h.by_gpu
            .get(&uuid(gpu))
            .map(|l| l.iter().map(|p| p.name.clone()).collect())
            .unwrap_or_default()
    }

    #[test]
    fn every_way_of_handing_out_a_gpu_names_its_pods() {
        let h = gpu_holders(&every_way(), &Placement::new(&readings(), dra_slices()));
        assert_eq!(h.unplaced, Vec::<String>::new());
        assert_eq!(names(&h, 0), ["by-uuid", "time-sliced"]);
        assert_eq!(names(&h, 3), ["by-index"]);
        assert_eq!(names(&h, 4), ["by-index"]);
        assert_eq!(names(&h, 5), ["dra"]);
        assert_eq!(names(&h, 6), ["mig-by-index", "mig-by-uuid"]);
        assert_eq!(h.unknown(), None);
        let c = &h.by_gpu[&uuid(0)][0];
        assert_eq!(
            (c.namespace.as_str(), c.container.as_deref()),
            ("ml", Some("main"))
        );
    }

    #[test]
    fn a_device_that_names_no_gpu_is_said_not_dropped() {
        // Without the ResourceSlice, the DRA GPU cannot be placed; an index
        // past the GPUs cannot either. The NIC's claim is no GPU's business.
        let mut response = every_way();
        response.pod_resources.push(pod(
            "stray",
            vec![devices("nvidia.com/gpu", &["9"])],
            vec![],
        ));
        let placement = Placement::new(&readings(), BTreeMap::new());
        assert!(unplaced_dra(&response, &placement));
        let h = gpu_holders(&response, &placement);
        assert_eq!(h.unplaced.len(), 2, "{:?}", h.unplaced);
        assert!(
            h.unplaced[0].contains("gpu.nvidia.com/node-1/gpu-5"),
            "{:?}",
            h.unplaced
        );
        assert!(h.unplaced[1].contains("pod ml/stray holds nvidia.com/gpu device \"9\""));
        let why = h.unknown().expect("unknown");
        assert!(why.contains("and 1 more"), "{why}");
        assert!(!unplaced_dra(
            &response,
            &Placement::new(&readings(), dra_slices())
        ));
    }

    struct Kubelet;

    #[tonic::async_trait]
    impl PodResourcesLister for Kubelet {
        async fn list(
            &self,
            _: Request<ListPodResourcesRequest>,
        ) -> Result<Response<ListPodResourcesResponse>, Status> {
            Ok(Response::new(every_way()))
        }

        async fn get_allocatable_resources(
            &self,
            _: Request<AllocatableResourcesRequest>,
        ) -> Result<Response<AllocatableResourcesResponse>, Status> {
            Ok(Response::new(offering(&[&uuid(0), "2", "6:2"])))
        }
    }

    /// The kubelet offering `ids` of `nvidia.com/gpu`, and a CPU-only
    /// plugin's device.
    fn offering(ids: &[&str]) -> AllocatableResourcesResponse {
        AllocatableResourcesResponse {
            devices: vec![
                devices("nvidia.com/gpu", ids),
                devices("example.com/fpga", &["0"]),
            ],
        }
    }

    #[test]
    fn a_gpu_is_offered_when_the_kubelet_offers_it_or_a_slice_of_it() {
        let placement = Placement::new(&readings(), dra_slices());
        let offered = offered_gpus(&offering(&[&uuid(0), "2", "6:2", "GPU-other"]), &placement)
            .expect("a device plugin offers GPUs");
        assert_eq!(
            offered,
            [uuid(0), uuid(2), uuid(6)].into_iter().collect(),
            "by UUID, by index and by a MIG slot; a device of no GPU here names none"
        );
        let none = AllocatableResourcesResponse {
            devices: vec![devices("example.com/fpga", &["0"])],
        };
        assert_eq!(
            offered_gpus(&none, &placement),
            None,
            "no GPU device plugin"
        );
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
        let deadline = std::time::Duration::from_secs(5);
        let response = list(&socket, deadline).await.expect("List over the socket");
        assert_eq!(response, every_way());
        let offered = allocatable(&socket, deadline)
            .await
            .expect("GetAllocatableResources over the socket");
        assert_eq!(offered, offering(&[&uuid(0), "2", "6:2"]));
        server.abort();

        let missing = list(&dir.join("absent.sock"), deadline)
            .await
            .expect_err("an error");
        assert!(missing.to_string().contains("absent.sock"), "{missing}");

        // A socket that accepts and never answers: the deadline ends the wait.
        let silent = dir.join("silent.sock");
        let _held = std::os::unix::net::UnixListener::bind(&silent).expect("bind");
        let hung = list(&silent, std::time::Duration::from_millis(300))
            .await
            .expect_err("a timeout");
        assert!(hung.to_string().contains("did not answer"), "{hung}");
    }
}
