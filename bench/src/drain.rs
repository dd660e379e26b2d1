//! gpuhealth's drain against `kubectl drain`: the same node, the same pods
//! (Deployments, some behind PodDisruptionBudgets that allow one disruption
//! at a time), alternated over repeats in one run.

use std::time::{Duration, Instant};

use gpuhealth_api::GpuNodeHealth;
use gpuhealth_e2e::{
    agent::{FakeAgent, write_report},
    kubectl, reports,
    sim::{GpuNodeSpec, SIM_GROUP_LABEL, gpu_node, pod_is_ready, set_cordon},
    wait,
};
use k8s_openapi::api::{
    apps::v1::Deployment,
    core::v1::{Namespace, Node, Pod},
    policy::v1::PodDisruptionBudget,
};
use kube::{
    Api, Client,
    api::{Patch, PatchParams, PostParams},
    runtime::watcher,
};
use serde_json::json;

use crate::{Args, Result, fleet, policy::create_policy, results::DrainComparison, stats};

const GROUP: &str = "bench-drain";
const NAMESPACE: &str = "bench-drain";
const TARGET: &str = "drain-0";
const SPARES: [&str; 2] = ["drain-1", "drain-2"];
/// Deployments the pods are split among; the first `WITH_PDB` have a PDB.
const APPS: usize = 10;
const WITH_PDB: usize = 3;
const STEP: Duration = Duration::from_secs(900);

#[derive(Clone, Copy, Debug, PartialEq)]
enum Tool {
    Kubectl,
    Gpuhealth,
}

pub async fn compare(args: &Args, client: &Client) -> Result<DrainComparison> {
    eprintln!(
        "[bench] drains: {} pods, gpuhealth and kubectl drain alternated {} times",
        args.drain_pods, args.drain_repeats
    );
    setup(client).await?;
    let _agent = FakeAgent::default().spawn(client.clone(), GROUP);
    let mut result = DrainComparison {
        pods: args.drain_pods,
        pods_behind_pdbs: replicas(args.drain_pods)[..WITH_PDB].iter().sum(),
        ..Default::default()
    };
    for repeat in 0..args.drain_repeats {
        let order = if repeat % 2 == 0 {
            [Tool::Kubectl, Tool::Gpuhealth]
        } else {
            [Tool::Gpuhealth, Tool::Kubectl]
        };
        for tool in order {
            place(args, client).await?;
            let seconds = match tool {
                Tool::Kubectl => by_kubectl(client).await?,
                Tool::Gpuhealth => by_gpuhealth(client).await?,
            };
            eprintln!("[bench] drain by {tool:?}: {seconds:.1}s");
            match tool {
                Tool::Kubectl => result.kubectl_seconds.push(seconds),
                Tool::Gpuhealth => result.gpuhealth_seconds.push(seconds),
            }
        }
    }
    result.ratio_of_medians =
        stats::median(&result.gpuhealth_seconds) / stats::median(&result.kubectl_seconds);
    Ok(result)
}

/// Replicas per Deployment, adding up to `pods`.
fn replicas(pods: usize) -> Vec<usize> {
    (0..APPS)
        .map(|i| pods / APPS + usize::from(i < pods % APPS))
        .collect()
}

async fn setup(client: &Client) -> Result<()> {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NAMESPACE}}))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await?;
    let nodes: Api<Node> = Api::all(client.clone());
    for name in std::iter::once(TARGET).chain(SPARES) {
        nodes
            .create(
                &PostParams::default(),
                &gpu_node(name, GROUP, &GpuNodeSpec::default()),
            )
            .await?;
        write_report(client, name, reports::healthy(NAMESPACE, &[])).await?;
    }
    create_policy(
        client,
        GROUP,
        // The same GPU fails on every repeat: no limit, or the third would
        // hand the node over for replacement instead of draining it.
        json!({"drain": {"scope": "AllPods", "timeout": "10m"}, "maxConcurrent": 1,
               "remediationLimits": {"perGpu": 0, "perNode": 0}}),
    )
    .await?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NAMESPACE);
    let budgets: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), NAMESPACE);
    // Created empty: each repeat scales them up onto the target node.
    for i in 0..APPS {
        let app = format!("app-{i}");
        let deployment: Deployment = serde_json::from_value(json!({
            "metadata": {"name": app},
            "spec": {
                "replicas": 0,
                "selector": {"matchLabels": {"app": app}},
                "template": {
                    "metadata": {"labels": {"app": app}},
                    "spec": {
                        "nodeSelector": {SIM_GROUP_LABEL: GROUP},
                        "terminationGracePeriodSeconds": 1,
                        "containers": [{"name": "c", "image": "bench",
                                        "resources": {"requests": {"cpu": "10m"}}}],
                    },
                },
            },
        }))?;
        deployments
            .create(&PostParams::default(), &deployment)
            .await?;
        if i < WITH_PDB {
            let pdb: PodDisruptionBudget = serde_json::from_value(json!({
                "metadata": {"name": app},
                "spec": {"maxUnavailable": 1, "selector": {"matchLabels": {"app": app}}},
            }))?;
            budgets.create(&PostParams::default(), &pdb).await?;
        }
    }
    Ok(())
}

/// Every pod on the target node, Ready, and the spares open for the pods
/// that leave it.
async fn place(args: &Args, client: &Client) -> Result<()> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), NAMESPACE);
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    scale_all(&deployments, None).await?;
    wait::until_set(
        pods.clone(),
        watcher::Config::default(),
        "no drain pods",
        STEP,
        |p| p.is_empty(),
    )
    .await?;
    for spare in SPARES {
        set_cordon(client, spare, true).await?;
    }
    set_cordon(client, TARGET, false).await?;
    scale_all(&deployments, Some(args.drain_pods)).await?;
    wait::until_set(
        pods,
        watcher::Config::default(),
        "every drain pod Ready on the target",
        STEP,
        |p| {
            p.len() == args.drain_pods
                && p.values().all(|pod| {
                    pod_is_ready(pod)
                        && pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(TARGET)
                })
        },
    )
    .await?;
    let budgets: Api<PodDisruptionBudget> = Api::namespaced(client.clone(), NAMESPACE);
    wait::until_set(
        budgets,
        watcher::Config::default(),
        "the PDBs allowing one disruption",
        STEP,
        |b| {
            b.len() == WITH_PDB
                && b.values()
                    .all(|pdb| pdb.status.as_ref().and_then(|s| s.disruptions_allowed) == Some(1))
        },
    )
    .await?;
    for spare in SPARES {
        set_cordon(client, spare, false).await?;
    }
    Ok(())
}

async fn scale_all(deployments: &Api<Deployment>, pods: Option<usize>) -> Result<()> {
    let counts = match pods {
        Some(n) => replicas(n),
        None => vec![0; APPS],
    };
    for (i, n) in counts.into_iter().enumerate() {
        deployments
            .patch(
                &format!("app-{i}"),
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"replicas": n}})),
            )
            .await?;
    }
    Ok(())
}

/// Both clocks run from the bench's trigger (`kubectl drain` started; the
/// GPU report written) to the last pod gone from the node, seen on one
/// watch of its pods: a person or a script runs `kubectl drain` when a
/// fault is seen, and gpuhealth's figure includes its reaction to it.
async fn drained_since(client: &Client, trigger: Instant) -> Result<f64> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let on_target = watcher::Config::default().fields(&format!("spec.nodeName={TARGET}"));
    wait::until_set(pods, on_target, "the target drained", STEP, |p| {
        p.is_empty()
    })
    .await?;
    Ok(trigger.elapsed().as_secs_f64())
}

/// `kubectl drain` (it cordons, evicts, retries refusals every 5 s, and
/// waits for the pods to go), from its start to the last pod gone.
async fn by_kubectl(client: &Client) -> Result<f64> {
    let started = Instant::now();
    let drain = async {
        kubectl(&[
            "drain",
            TARGET,
            "--ignore-daemonsets",
            "--delete-emptydir-data",
            "--timeout=600s",
        ])
        .await
        .map_err(Into::into)
    };
    let (_, seconds) = futures::future::try_join(drain, drained_since(client, started)).await?;
    kubectl(&["uncordon", TARGET]).await?;
    Ok(seconds)
}

/// gpuhealth's drain, from the GPU report's write to the last pod gone;
/// then the reset and the uncordon are let finish.
async fn by_gpuhealth(client: &Client) -> Result<f64> {
    let health: Api<GpuNodeHealth> = Api::all(client.clone());
    let incidents = health
        .get(TARGET)
        .await?
        .status
        .map_or(0, |s| s.history.len());
    let written = Instant::now();
    fleet::break_gpu(client, TARGET).await?;
    let seconds = drained_since(client, written).await?;
    wait::until(health, TARGET, STEP, |h| {
        h.status.as_ref().is_some_and(|s| {
            s.phase == gpuhealth_api::node_health::Phase::Healthy && s.history.len() > incidents
        })
    })
    .await?;
    Ok(seconds)
}
