//! What a training gang loses to one bad GPU, in GPU-hours, with
//! `drain.gangs.mode: Whole` against `Member` (every pod alone, what
//! gpuhealth did before gangs and what a per-pod drain does): the same
//! gang, the same nodes, one after the other in one run.
//!
//! A gang of `--gang-nodes` nodes, eight ranks on each (bare pods bound to
//! a GPU each, labelled as a JobSet's), GPU 7 of the first node failing as
//! in the incident. Every rank stops at its next collective once one rank's
//! GPU is gone; the GPU-hours lost are the ranks' GPUs held from the fault
//! until the gang is down, ready to restart:
//!
//! - `Whole`: measured, from the report's write to the last rank gone
//!   (deleted), the notice included; every rank is told first.
//! - `Member`: the bad GPU's rank goes (measured); the others hang until
//!   the job's own collective timeout fails them (`--gang-hang-timeout`,
//!   PyTorch's default for NCCL, 10 minutes: stated, not measured) and its
//!   controller restarts the job, which counts as the job's failure.
//!
//! The restart itself (scheduling, start-up, loading the checkpoint) costs
//! the same in both and is left out of both.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures::StreamExt;
use gpuhealth_api::{GpuHealthPolicy, GpuNodeHealth, gang::EVICT_AT_ANNOTATION};
use gpuhealth_e2e::{
    agent::{FakeAgent, write_report},
    reports,
    sim::{GPU_RESOURCE, GpuNodeSpec, gpu_node},
    wait::{self, Background, events},
};
use k8s_openapi::api::core::v1::{Namespace, Node, Pod};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams},
    runtime::watcher,
};
use serde_json::json;

use crate::{
    Args, Result,
    fleet::{self, recovered},
    policy::create_policy,
    results::GangComparison,
    say,
};

const GROUP: &str = "bench-gang";
const NAMESPACE: &str = "bench-gang";
const JOBSET_LABEL: &str = "jobset.sigs.k8s.io/jobset-name";
const GANG: &str = "train";
const RANKS_PER_NODE: usize = 8;
/// How long a gang may take to leave, or to come back.
const STEP: Duration = Duration::from_secs(600);

fn node_name(i: usize) -> String {
    format!("gang-{i:03}")
}

fn rank_name(node: &str, gpu: usize) -> String {
    format!("{node}-rank{gpu}")
}

/// When each rank was first seen told and first seen gone.
#[derive(Default)]
struct Seen {
    told: BTreeMap<String, Instant>,
    gone: BTreeMap<String, Instant>,
}

fn lock(seen: &Mutex<Seen>) -> std::sync::MutexGuard<'_, Seen> {
    seen.lock().unwrap_or_else(|e| e.into_inner())
}

pub async fn compare(args: &Args, client: &Client) -> Result<GangComparison> {
    let nodes: Vec<String> = (0..args.gang_nodes).map(node_name).collect();
    let ranks = nodes.len() * RANKS_PER_NODE;
    say(&format!(
        "a training gang of {ranks} ranks on {} nodes: Whole, then Member",
        nodes.len()
    ));
    setup(args, client, &nodes).await?;
    let _agent = FakeAgent::default().spawn(client.clone(), GROUP);
    taken_in(client, &nodes).await?;
    let bad = nodes[0].clone();
    let bad_rank = rank_name(&bad, 7);

    let mut result = GangComparison {
        nodes: nodes.len(),
        ranks,
        notice_seconds: args.gang_notice_secs as f64,
        hang_timeout_seconds: args.gang_hang_timeout_secs as f64,
        ..Default::default()
    };

    // Whole: every rank told, then all gone together.
    set_mode(client, "Whole").await?;
    place(client, &nodes).await?;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let watching = watch(client, &seen);
    let fault = fleet::break_gpu(client, &bad).await?;
    wait_for(&seen, "every rank gone", |s| s.gone.len() == ranks).await?;
    {
        let s = lock(&seen);
        let last = |m: &BTreeMap<String, Instant>| m.values().max().copied();
        let first_gone = s.gone.values().min().copied();
        result.whole_seconds = since(fault, last(&s.gone));
        result.whole_all_told_seconds = since(fault, last(&s.told));
        result.whole_told_before_any_left =
            s.told.len() == ranks && last(&s.told).zip(first_gone).is_some_and(|(t, g)| t <= g);
    }
    drop(watching);
    recovered(client, std::slice::from_ref(&bad)).await?;

    // Member: the bad GPU's rank alone.
    set_mode(client, "Member").await?;
    place(client, &nodes).await?;
    let seen = Arc::new(Mutex::new(Seen::default()));
    let watching = watch(client, &seen);
    let fault = fleet::break_gpu(client, &bad).await?;
    wait_for(&seen, "the bad GPU's rank gone", |s| {
        s.gone.contains_key(&bad_rank)
    })
    .await?;
    recovered(client, std::slice::from_ref(&bad)).await?;
    {
        let s = lock(&seen);
        result.member_seconds = since(fault, s.gone.get(&bad_rank).copied());
        result.member_ranks_left = ranks - s.gone.len();
    }
    drop(watching);

    teardown(client, &nodes).await?;

    let gpu_hours = |seconds: f64| ranks as f64 * seconds / 3600.0;
    result.whole_gpu_hours = gpu_hours(result.whole_seconds);
    result.member_gpu_hours = gpu_hours(result.member_seconds.max(result.hang_timeout_seconds));
    result.ratio = result.whole_gpu_hours / result.member_gpu_hours;
    say(&format!(
        "gang: Whole down in {:.1} s ({:.2} GPU-h); Member's rank gone in {:.1} s, the rest hang {:.0} s ({:.2} GPU-h)",
        result.whole_seconds,
        result.whole_gpu_hours,
        result.member_seconds,
        result.hang_timeout_seconds,
        result.member_gpu_hours
    ));
    Ok(result)
}

fn since(from: Instant, to: Option<Instant>) -> f64 {
    to.map_or(f64::NAN, |t| t.duration_since(from).as_secs_f64())
}

async fn setup(args: &Args, client: &Client, nodes: &[String]) -> Result<()> {
    let ns: Namespace = serde_json::from_value(json!({"metadata": {"name": NAMESPACE}}))?;
    Api::<Namespace>::all(client.clone())
        .create(&PostParams::default(), &ns)
        .await?;
    let api: Api<Node> = Api::all(client.clone());
    for name in nodes {
        api.create(
            &PostParams::default(),
            &gpu_node(name, GROUP, &GpuNodeSpec::default()),
        )
        .await?;
    }
    let notice = format!("{}s", args.gang_notice_secs);
    // The same GPU fails twice: no limit, or the second would hand it over.
    create_policy(
        client,
        GROUP,
        json!({"drain": {"gangs": {"mode": "Whole", "notice": notice}}, "maxConcurrent": 1,
               "remediationLimits": {"perGpu": 0, "perNode": 0}}),
    )
    .await
}

/// Every node of the gang under the gang's policy.
async fn taken_in(client: &Client, nodes: &[String]) -> Result<()> {
    wait::until_set(
        Api::<GpuNodeHealth>::all(client.clone()),
        watcher::Config::default(),
        "the gang's nodes taken in",
        STEP,
        |all| {
            nodes.iter().all(|n| {
                all.get(n)
                    .and_then(|h| h.status.as_ref())
                    .is_some_and(|s| s.policy.as_deref() == Some(GROUP))
            })
        },
    )
    .await?;
    Ok(())
}

/// The gang's ranks and nodes gone, so that the phases after this one
/// measure the fleet they measured before it.
async fn teardown(client: &Client, nodes: &[String]) -> Result<()> {
    Api::<Namespace>::all(client.clone())
        .delete(NAMESPACE, &DeleteParams::default())
        .await?;
    let api: Api<Node> = Api::all(client.clone());
    for node in nodes {
        api.delete(node, &DeleteParams::default()).await?;
    }
    Api::<GpuHealthPolicy>::all(client.clone())
        .delete(GROUP, &DeleteParams::default())
        .await?;
    Ok(())
}

async fn set_mode(client: &Client, mode: &str) -> Result<()> {
    let patch = json!({"spec": {"drain": {"gangs": {"mode": mode}}}});
    Api::<GpuHealthPolicy>::all(client.clone())
        .patch(GROUP, &PatchParams::default(), &Patch::Merge(patch))
        .await?;
    Ok(())
}

/// Every rank running on its GPU, named in its node's report, none left
/// from the last round.
async fn place(client: &Client, nodes: &[String]) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    wait::within("the last round's ranks gone", STEP, async {
        loop {
            let left = pods.list(&ListParams::default()).await?;
            if left
                .items
                .iter()
                .all(|p| p.metadata.deletion_timestamp.is_none())
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await?;
    for node in nodes {
        let ranks: Vec<String> = (0..RANKS_PER_NODE).map(|g| rank_name(node, g)).collect();
        for rank in &ranks {
            let pod: Pod = serde_json::from_value(json!({
                "metadata": {"name": rank, "namespace": NAMESPACE,
                             "labels": {JOBSET_LABEL: GANG}},
                "spec": {
                    "nodeName": node,
                    "terminationGracePeriodSeconds": 1,
                    "containers": [{"name": "rank", "image": "bench",
                                    "resources": {"limits": {GPU_RESOURCE: "1"}}}],
                },
            }))?;
            match pods.create(&PostParams::default(), &pod).await {
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                other => {
                    other?;
                }
            }
        }
        write_report(client, node, reports::healthy(NAMESPACE, &ranks)).await?;
    }
    Ok(())
}

/// Records, until dropped, when each rank is first told and first gone
/// (its deletion begun, or deleted).
fn watch(client: &Client, seen: &Arc<Mutex<Seen>>) -> Background {
    let seen = seen.clone();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    Background::spawn(async move {
        let mut stream = std::pin::pin!(events(pods, watcher::Config::default()));
        while let Some(event) = stream.next().await {
            let now = Instant::now();
            let (pod, deleted) = match event {
                watcher::Event::Apply(p) | watcher::Event::InitApply(p) => (p, false),
                watcher::Event::Delete(p) => (p, true),
                _ => continue,
            };
            let mut s = lock(&seen);
            let name = pod.name_any();
            if pod.annotations().contains_key(EVICT_AT_ANNOTATION) {
                s.told.entry(name.clone()).or_insert(now);
            }
            if deleted || pod.metadata.deletion_timestamp.is_some() {
                s.gone.entry(name).or_insert(now);
            }
        }
    })
}

async fn wait_for(seen: &Mutex<Seen>, what: &str, done: impl Fn(&Seen) -> bool) -> Result<()> {
    wait::within(what, STEP, async {
        while !done(&lock(seen)) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    })
    .await?;
    Ok(())
}
