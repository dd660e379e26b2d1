//! gpuhealth-sim: makes simulated GPU nodes and GPU workloads on the cluster
//! in `GPUHEALTH_E2E_KUBECONFIG` (or the local test cluster), and waits until
//! they are Ready. `make demo` uses it.

use std::{process::ExitCode, time::Duration};

use clap::{Parser, Subcommand};
use gpuhealth_e2e::{
    client,
    sim::{GpuNodeSpec, SIM_GROUP_LABEL, gpu_deployment, gpu_node, node_is_ready},
    wait::{until, until_set},
};
use k8s_openapi::api::{
    apps::v1::Deployment,
    core::v1::{Namespace, Node},
};
use kube::{
    Api,
    api::{ObjectMeta, Patch, PatchParams},
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
        Command::Nodes { group, count, gpus } => {
            let nodes: Api<Node> = Api::all(client);
            let spec = GpuNodeSpec {
                gpus,
                ..Default::default()
            };
            for i in 0..count {
                let name = format!("{group}-{i}");
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
    }
    Ok(())
}
