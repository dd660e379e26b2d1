//! What an incident costs in capacity, per-GPU quarantine against the
//! node-wide cordon, on the same nodes in the same run: the schedulable
//! GPU-seconds each incident took away, as a watch on the cluster saw them
//! (a cordoned node's eight GPUs for as long as it was cordoned, a fenced
//! GPU for as long as its `DeviceTaintRule` was up).

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::Instant,
};

use futures::{StreamExt, future::try_join_all};
use gpuhealth_api::{
    GpuHealthPolicy,
    quarantine::{MANAGED_BY_LABEL, QuarantineScope, RULE_NODE_LABEL},
};
use gpuhealth_e2e::{
    dra, reports,
    sim::{SIM_GROUP_LABEL, is_cordoned},
    wait::{Background, applied, events},
};
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api, Client, ResourceExt,
    api::{Patch, PatchParams},
    runtime::watcher,
};
use serde_json::json;

use crate::{
    Result,
    fleet::{self, GROUP, recovered},
    results::Capacity,
    stats::median,
};

/// The GPUs of a simulated node: a cordon takes them all.
const GPUS_PER_NODE: f64 = 8.0;

/// From when to when something kept GPUs from new work.
type Span = (Instant, Instant);

/// One node's cordons: the one on now, since when, and those ended.
#[derive(Default)]
struct Cordons {
    since: Option<Instant>,
    ended: Vec<Span>,
}

/// One node's rules: those up now, since when, and those ended.
#[derive(Default)]
struct Fences {
    up: BTreeMap<String, Instant>,
    ended: Vec<Span>,
}

/// What kept each node's GPUs from new work.
#[derive(Default)]
struct Spans {
    cordoned: BTreeMap<String, Cordons>,
    fenced: BTreeMap<String, Fences>,
}

/// GPU-seconds `node` lost after `since`, and whether it was cordoned.
fn lost(spans: &Spans, node: &str, since: Instant) -> (f64, bool) {
    let after = |v: &[Span]| -> Vec<f64> {
        v.iter()
            .filter(|(from, _)| *from >= since)
            .map(|(from, to)| to.duration_since(*from).as_secs_f64())
            .collect()
    };
    let cordons = spans
        .cordoned
        .get(node)
        .map(|c| after(&c.ended))
        .unwrap_or_default();
    let rules = spans
        .fenced
        .get(node)
        .map(|f| after(&f.ended))
        .unwrap_or_default();
    let seconds = GPUS_PER_NODE * cordons.iter().sum::<f64>() + rules.iter().sum::<f64>();
    (seconds, !cordons.is_empty())
}

fn lock(spans: &Mutex<Spans>) -> std::sync::MutexGuard<'_, Spans> {
    spans.lock().unwrap_or_else(|e| e.into_inner())
}

/// Records, until dropped, when each simulated node is cordoned and when
/// each of gpuhealth's rules is up.
fn watch(client: &Client, spans: &Arc<Mutex<Spans>>) -> Vec<Background> {
    let nodes = {
        let spans = spans.clone();
        let api: Api<Node> = Api::all(client.clone());
        let config = watcher::Config::default().labels(SIM_GROUP_LABEL);
        Background::spawn(async move {
            let mut stream = std::pin::pin!(applied(api, config));
            while let Some(node) = stream.next().await {
                let now = Instant::now();
                let mut s = lock(&spans);
                let c = s.cordoned.entry(node.name_any()).or_default();
                match (is_cordoned(&node), c.since) {
                    (true, None) => c.since = Some(now),
                    (false, Some(from)) => {
                        c.ended.push((from, now));
                        c.since = None;
                    }
                    _ => {}
                }
            }
        })
    };
    let rules = {
        let spans = spans.clone();
        let client = client.clone();
        let config = watcher::Config::default()
            .labels(&format!("{}={}", MANAGED_BY_LABEL.0, MANAGED_BY_LABEL.1));
        Background::spawn(async move {
            // A cluster that serves no rules has no spans of them.
            let Some(api) = dra::rules_once_answered(&client).await else {
                return;
            };
            let mut stream = std::pin::pin!(events(api, config));
            while let Some(event) = stream.next().await {
                let now = Instant::now();
                let (rule, up) = match event {
                    watcher::Event::Apply(r) | watcher::Event::InitApply(r) => (r, true),
                    watcher::Event::Delete(r) => (r, false),
                    _ => continue,
                };
                let Some(node) = rule.labels().get(RULE_NODE_LABEL).cloned() else {
                    continue;
                };
                let mut s = lock(&spans);
                let f = s.fenced.entry(node).or_default();
                if up {
                    f.up.entry(rule.name_any()).or_insert(now);
                } else if let Some(from) = f.up.remove(&rule.name_any()) {
                    f.ended.push((from, now));
                }
            }
        })
    };
    vec![nodes, rules]
}

/// `nodes` (healthy, recovered, served by the fake agent) publish their
/// GPUs as DRA devices; GPU 7 of each fails at once, under the policy's
/// `quarantine.scope` `Auto` (each GPU fenced alone), then again under
/// `Node`; each incident's lost GPU-seconds are measured once its node is
/// back in service.
pub async fn compare(
    client: &Client,
    policies: &Api<GpuHealthPolicy>,
    nodes: &[String],
) -> Result<Capacity> {
    dra::ensure_device_class(client).await?;
    let report = reports::healthy(fleet::NAMESPACE, &[]);
    for node in nodes {
        dra::publish(client, node, &report).await?;
    }
    let spans: Arc<Mutex<Spans>> = Arc::default();
    let _watches = watch(client, &spans);
    let mut capacity = Capacity {
        incidents: nodes.len(),
        ..Default::default()
    };
    for scope in [QuarantineScope::Auto, QuarantineScope::Node] {
        policies
            .patch(
                GROUP,
                &PatchParams::default(),
                // The same GPU fails twice: no hand-over for replacement.
                &Patch::Merge(json!({"spec": {
                    "quarantine": {"scope": scope},
                    "remediationLimits": {"perGpu": 0, "perNode": 0},
                }})),
            )
            .await?;
        let since = Instant::now();
        try_join_all(nodes.iter().map(|n| fleet::break_gpu(client, n))).await?;
        recovered(client, nodes).await?;
        back_in_service(&spans, nodes, since).await?;
        let seen: Vec<(f64, bool)> = {
            let s = lock(&spans);
            nodes.iter().map(|n| lost(&s, n, since)).collect()
        };
        let seconds: Vec<f64> = seen.iter().map(|(g, _)| *g).collect();
        let cordoned = seen.iter().filter(|(_, c)| *c).count();
        match scope {
            QuarantineScope::Node => {
                capacity.node_wide_gpu_seconds = seconds;
                capacity.node_wide_cordoned = cordoned;
            }
            _ => {
                capacity.per_gpu_gpu_seconds = seconds;
                capacity.per_gpu_cordoned = cordoned;
            }
        }
    }
    let per_gpu = median(&capacity.per_gpu_gpu_seconds);
    let node_wide = median(&capacity.node_wide_gpu_seconds);
    capacity.ratio_of_medians = if node_wide > 0.0 {
        per_gpu / node_wide
    } else {
        0.0
    };
    Ok(capacity)
}

/// Waits (a bounded while) until no node of `nodes` is cordoned or has a
/// rule up: the status says recovered before the uncordon and the rule's
/// deletion land.
async fn back_in_service(spans: &Mutex<Spans>, nodes: &[String], since: Instant) -> Result<()> {
    let deadline = Instant::now() + std::time::Duration::from_secs(120);
    loop {
        let done = {
            let s = lock(spans);
            nodes.iter().all(|n| {
                let uncordoned = s.cordoned.get(n).is_none_or(|c| c.since.is_none());
                let unfenced = s.fenced.get(n).is_none_or(|f| f.up.is_empty());
                let ended_since = |e: &[Span]| e.iter().any(|(from, _)| *from >= since);
                let measured = s.cordoned.get(n).is_some_and(|c| ended_since(&c.ended))
                    || s.fenced.get(n).is_some_and(|f| ended_since(&f.ended));
                uncordoned && unfenced && measured
            })
        };
        if done {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err("nodes not back in service (uncordoned, their GPUs' rules gone) within 2 minutes of recovering".into());
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}
