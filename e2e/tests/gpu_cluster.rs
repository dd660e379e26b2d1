//! The simulated GPU cluster behaves like a real one where later features
//! rely on it: KWOK nodes become Ready with GPUs allocatable, the scheduler
//! places GPU pods by GPU count, the controller manager computes
//! PodDisruptionBudget status, and the Eviction API enforces it.

use std::{collections::BTreeSet, time::Duration};

use gpuhealth_e2e::{
    client,
    sim::{
        GPU_RESOURCE, GpuNodeSpec, SIM_GROUP_LABEL, gpu_deployment, gpu_node, node_is_ready,
        pod_is_ready,
    },
    unique,
    wait::{until, until_set},
};
use k8s_openapi::{
    api::{
        apps::v1::Deployment,
        core::v1::{Namespace, Node, Pod},
        policy::v1::{PodDisruptionBudget, PodDisruptionBudgetSpec},
    },
    apimachinery::pkg::{
        apis::meta::v1::{LabelSelector, ObjectMeta},
        util::intstr::IntOrString,
    },
};
use kube::{
    Api, Client, ResourceExt,
    api::{EvictParams, ListParams, Patch, PatchParams, PostParams},
    runtime::watcher,
};

const NODES: usize = 10;
const WAIT: Duration = Duration::from_secs(180);

fn ready_with_eight_gpus(node: &Node) -> bool {
    let gpus = node
        .status
        .as_ref()
        .and_then(|s| s.allocatable.as_ref())
        .and_then(|a| a.get(GPU_RESOURCE));
    node_is_ready(node) && gpus.is_some_and(|q| q.0 == "8")
}

async fn gpu_nodes(client: &Client, group: &str) -> Vec<String> {
    let nodes: Api<Node> = Api::all(client.clone());
    let mut names = Vec::new();
    for i in 0..NODES {
        let name = format!("{group}-{i}");
        let node = gpu_node(&name, group, &GpuNodeSpec::default());
        nodes
            .create(&PostParams::default(), &node)
            .await
            .expect("node created");
        names.push(name);
    }
    let config = watcher::Config::default().labels(&format!("{SIM_GROUP_LABEL}={group}"));
    until_set(nodes, config, "ten Ready GPU nodes", WAIT, |set| {
        set.len() == NODES && set.values().all(ready_with_eight_gpus)
    })
    .await
    .expect("ten simulated GPU nodes become Ready with nvidia.com/gpu: 8");
    names
}

async fn namespace(client: &Client) -> String {
    let name = unique("e2e");
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(name.clone()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await
        .expect("namespace");
    name
}

#[tokio::test]
async fn gpu_pods_schedule_onto_simulated_nodes_and_pdbs_hold() {
    let client = client().await.expect("test cluster");
    let started = std::time::Instant::now();
    let step = |what: &str| eprintln!("[{:>6.1}s] {what}", started.elapsed().as_secs_f32());
    let group = unique("gpu");
    let node_names: BTreeSet<String> = gpu_nodes(&client, &group).await.into_iter().collect();
    step("nodes Ready");
    let ns = namespace(&client).await;

    // Ten pods of eight GPUs each fill ten eight-GPU nodes exactly: the
    // scheduler must account GPUs to place them one per node.
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &ns);
    let name = "vllm";
    deployments
        .create(
            &PostParams::default(),
            &gpu_deployment(&ns, name, &group, NODES as i32, 8),
        )
        .await
        .expect("deployment created");
    until(deployments.clone(), name, WAIT, |d| {
        d.status.as_ref().and_then(|s| s.ready_replicas) == Some(NODES as i32)
    })
    .await
    .expect("the GPU deployment becomes Ready");
    step("deployment Ready");

    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let placed: Vec<String> = pods
        .list(&ListParams::default().labels("app=vllm"))
        .await
        .expect("list pods")
        .into_iter()
        .filter_map(|p| p.spec.and_then(|s| s.node_name))
        .collect();
    let distinct: BTreeSet<String> = placed.iter().cloned().collect();
    assert_eq!(placed.len(), NODES, "{placed:?}");
    assert_eq!(
        distinct, node_names,
        "one eight-GPU pod on each simulated node"
    );

    // A budget that allows no disruption: the controller manager computes its
    // status, and the Eviction API refuses with 429.
    let pdbs: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), &ns);
    let pdb = PodDisruptionBudget {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        spec: Some(PodDisruptionBudgetSpec {
            min_available: Some(IntOrString::Int(NODES as i32)),
            selector: Some(LabelSelector {
                match_labels: Some([("app".into(), name.into())].into()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    };
    pdbs.create(&PostParams::default(), &pdb)
        .await
        .expect("pdb created");
    let computed = |p: &PodDisruptionBudget, allowed: i32| {
        p.status.as_ref().is_some_and(|s| {
            s.observed_generation == p.metadata.generation
                && s.current_healthy == Some(NODES as i32)
                && s.disruptions_allowed == Some(allowed)
        })
    };
    until(pdbs.clone(), name, WAIT, |p| computed(p, 0))
        .await
        .expect("PDB status computed");
    step("PDB status computed");

    let victim = pods
        .list(&ListParams::default().labels("app=vllm"))
        .await
        .expect("list")
        .items[0]
        .name_any();
    match pods.evict(&victim, &EvictParams::default()).await {
        Err(kube::Error::Api(status)) => {
            assert_eq!(
                status.code, 429,
                "eviction beyond the budget is refused with 429: {status:?}"
            );
        }
        other => panic!("eviction beyond the budget must be refused, got {other:?}"),
    }

    // Loosen the budget: the same eviction is now allowed, and the
    // ReplicaSet replaces the pod on the node the eviction freed.
    pdbs.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"spec": {"minAvailable": NODES - 1}})),
    )
    .await
    .expect("pdb loosened");
    until(pdbs.clone(), name, WAIT, |p| computed(p, 1))
        .await
        .expect("PDB allows one disruption");
    step("PDB loosened");
    pods.evict(&victim, &EvictParams::default())
        .await
        .expect("eviction within the budget succeeds");
    let config = watcher::Config::default().labels("app=vllm");
    until_set(pods, config, "replacement pod Ready", WAIT, |set| {
        !set.contains_key(&victim) && set.len() == NODES && set.values().all(pod_is_ready)
    })
    .await
    .expect("the evicted pod is replaced and Ready");
    step("evicted pod replaced");
}
