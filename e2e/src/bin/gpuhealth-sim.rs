//! gpuhealth-sim: makes simulated GPU nodes and GPU workloads on the cluster
//! in `GPUHEALTH_E2E_KUBECONFIG` (or the local test cluster), and waits until
//! they are Ready. `make demo` uses it.

use std::{process::ExitCode, time::Duration};

use clap::{Parser, Subcommand};
use gpuhealth_agent::fake::{SIM_HARDWARE_ANNOTATION, SimHardware, SimOutcome};
use gpuhealth_api::contract::PodRef;
use gpuhealth_e2e::{
    client,
    node_agent::{hardware, set_hardware},
    reports,
    sim::{GpuNodeSpec, SIM_GROUP_LABEL, gpu_deployment, gpu_node, node_is_ready},
    wait::{until, until_set},
};
use k8s_openapi::api::{
    apps::v1::Deployment,
    core::v1::{Namespace, Node, Pod},
};
use kube::{
    Api, ResourceExt,
    api::{ListParams, ObjectMeta, Patch, PatchParams},
    runtime::watcher,
};

const WAIT: Duration = Duration::from_secs(180);

#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Create `count` KWOK GPU nodes named `<group>-<i>` and wait until Ready.
    Nodes {
        #[arg(long)]
        group: String,
        /// Name a single node (instead of `<group>-<i>`).
        #[arg(long, conflicts_with = "count")]
        name: Option<String>,
        #[arg(long, default_value_t = 4)]
        count: usize,
        #[arg(long, default_value_t = 8)]
        gpus: u32,
    },
    /// Create a GPU Deployment pinned to a node group and wait until Ready.
    Deploy {
        #[arg(long)]
        namespace: String,
        #[arg(long)]
        name: String,
        #[arg(long)]
        group: String,
        #[arg(long, default_value_t = 4)]
        replicas: i32,
        #[arg(long, default_value_t = 1)]
        gpus_per_pod: u32,
    },
    /// Give a node simulated hardware: healthy GPUs, GPU i held by the i-th
    /// pod (by name) of a namespace that runs on it. `gpuhealth-agent
    /// --backend fake` reads it and reports it.
    Hardware {
        #[arg(long)]
        node: String,
        #[arg(long)]
        namespace: String,
    },
    /// The kubelet's device manager for a node's simulated hardware, until
    /// stopped: a pod of `namespace` that leaves the node frees its GPU, a
    /// new one takes the lowest free GPU, so the agent's report names only
    /// pods that hold a GPU now.
    Kubelet {
        #[arg(long)]
        node: String,
        #[arg(long)]
        namespace: String,
    },
    /// The incident in a node's simulated hardware: Xid 119 then Xid 154
    /// (0x1 GPU Reset Required) on one GPU.
    Xid {
        #[arg(long)]
        node: String,
        #[arg(long)]
        namespace: String,
        #[arg(long, default_value_t = 7)]
        gpu: usize,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    match run(Args::parse().command).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpuhealth-sim: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(command: Command) -> Result<(), Box<dyn std::error::Error>> {
    let client = client().await?;
    let apply = PatchParams::apply("gpuhealth-sim").force();
    match command {
        Command::Nodes {
            group,
            name,
            count,
            gpus,
        } => {
            let nodes: Api<Node> = Api::all(client);
            let spec = GpuNodeSpec {
                gpus,
                ..Default::default()
            };
            let names: Vec<String> = match name {
                Some(n) => vec![n],
                None => (0..count).map(|i| format!("{group}-{i}")).collect(),
            };
            let count = names.len();
            for name in names {
                nodes
                    .patch(&name, &apply, &Patch::Apply(gpu_node(&name, &group, &spec)))
                    .await?;
            }
            let selector = watcher::Config::default().labels(&format!("{SIM_GROUP_LABEL}={group}"));
            until_set(nodes, selector, "simulated GPU nodes Ready", WAIT, |set| {
                set.len() == count && set.values().all(node_is_ready)
            })
            .await?;
            println!("{count} simulated GPU nodes Ready ({gpus} GPUs each, group {group})");
        }
        Command::Deploy {
            namespace,
            name,
            group,
            replicas,
            gpus_per_pod,
        } => {
            let ns = Namespace {
                metadata: ObjectMeta {
                    name: Some(namespace.clone()),
                    ..Default::default()
                },
                ..Default::default()
            };
            Api::<Namespace>::all(client.clone())
                .patch(&namespace, &apply, &Patch::Apply(ns))
                .await?;
            let deployments: Api<Deployment> = Api::namespaced(client, &namespace);
            let deployment = gpu_deployment(&namespace, &name, &group, replicas, gpus_per_pod);
            deployments
                .patch(&name, &apply, &Patch::Apply(deployment))
                .await?;
            until(deployments, &name, WAIT, |d| {
                d.status.as_ref().and_then(|s| s.ready_replicas) == Some(replicas)
            })
            .await?;
            println!("deployment {namespace}/{name} Ready: {replicas} pods x {gpus_per_pod} GPU");
        }
        Command::Hardware { node, namespace } => {
            let report = reports::healthy(&namespace, &pods_on(&client, &node, &namespace).await?);
            let hardware = SimHardware {
                gpus: report.gpus,
                reset: SimOutcome::Succeed,
                reboot: SimOutcome::Succeed,
                reset_takes: None,
                executed: Vec::new(),
                capabilities: None,
            };
            set_hardware(&client, &node, &hardware).await?;
            println!(
                "{node}: simulated hardware with {} healthy GPUs",
                hardware.gpus.len()
            );
        }
        Command::Kubelet { node, namespace } => loop {
            let nodes: Api<Node> = Api::all(client.clone());
            let current = nodes.get(&node).await?;
            if let (Some(mut hw), Some(was)) = (
                hardware(&current),
                current.annotations().get(SIM_HARDWARE_ANNOTATION),
            ) {
                let here = pods_on(&client, &node, &namespace).await?;
                if give_gpus(&mut hw, &namespace, &here) {
                    // Only over the hardware just read: the agent writes it
                    // too (a reset heals it), and neither may undo the other.
                    let path = format!(
                        "/metadata/annotations/{}",
                        SIM_HARDWARE_ANNOTATION.replace('/', "~1")
                    );
                    let patch: json_patch::Patch = serde_json::from_value(serde_json::json!([
                        {"op": "test", "path": path, "value": was},
                        {"op": "replace", "path": path, "value": serde_json::to_string(&hw)?},
                    ]))?;
                    match nodes
                        .patch(&node, &PatchParams::default(), &Patch::Json::<()>(patch))
                        .await
                    {
                        Ok(_) | Err(kube::Error::Api(_)) => {}
                        Err(e) => return Err(e.into()),
                    }
                }
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        },
        Command::Xid {
            node,
            namespace,
            gpu,
        } => {
            let nodes: Api<Node> = Api::all(client.clone());
            let mut hardware = hardware(&nodes.get(&node).await?)
                .ok_or_else(|| format!("{node} has no simulated hardware: run `hardware` first"))?;
            let mut report = reports::healthy(&namespace, &[]);
            report.gpus = hardware.gpus;
            reports::xid_119_and_154(&mut report, gpu);
            hardware.gpus = report.gpus;
            set_hardware(&client, &node, &hardware).await?;
            println!(
                "NVRM: Xid (PCI:0000:e1:00): 119, Timeout after 45s of waiting for RPC response from GPU GSP"
            );
            println!(
                "NVRM: Xid (PCI:0000:e1:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)"
            );
        }
    }
    Ok(())
}

/// Frees the GPUs of pods no longer `here` and gives free GPUs to new ones,
/// lowest index first; whether anything changed.
fn give_gpus(hardware: &mut SimHardware, namespace: &str, here: &[String]) -> bool {
    let mut changed = false;
    for gpu in &mut hardware.gpus {
        let before = gpu.pods.len();
        gpu.pods
            .retain(|p| p.namespace != namespace || here.contains(&p.name));
        changed |= gpu.pods.len() != before;
    }
    for pod in here {
        let held = hardware.gpus.iter().any(|g| {
            g.pods
                .iter()
                .any(|p| p.namespace == namespace && &p.name == pod)
        });
        if held {
            continue;
        }
        if let Some(free) = hardware.gpus.iter_mut().find(|g| g.pods.is_empty()) {
            free.pods.push(PodRef {
                namespace: namespace.to_owned(),
                name: pod.clone(),
                container: Some("server".into()),
            });
            changed = true;
        }
    }
    changed
}

/// Names of the pods of `namespace` on `node`, sorted.
async fn pods_on(client: &kube::Client, node: &str, namespace: &str) -> kube::Result<Vec<String>> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let list = pods
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await?;
    let mut names: Vec<String> = list
        .iter()
        .filter(|p| {
            let phase = p.status.as_ref().and_then(|s| s.phase.as_deref());
            !matches!(phase, Some("Succeeded" | "Failed"))
        })
        .map(|p| p.name_any())
        .collect();
    names.sort();
    Ok(names)
}
