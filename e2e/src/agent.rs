//! A fake node agent for simulated nodes, standing in for the real agent's
//! fake backend until it exists: it writes the GPU report a scenario asks
//! for, answers reset and reboot requests with the outcome the scenario
//! chooses, and changes the node's bootID on a successful reboot.

use std::{
    collections::BTreeSet,
    sync::{Arc, Mutex},
};

use futures::StreamExt;
use gpuhealth_api::{
    GpuHealth,
    contract::{
        AnnotationValue, GPU_REPORT_ANNOTATION, GpuReport, Outcome, REBOOT_REQUEST_ANNOTATION,
        REQUEST_RESULT_ANNOTATION, RESET_REQUEST_ANNOTATION, RebootRequest, RequestResult,
        ResetRequest,
    },
};
use k8s_openapi::{api::core::v1::Node, apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use kube::{
    Api, Client, ResourceExt,
    api::{Patch, PatchParams},
    runtime::watcher,
};
use serde_json::json;

use crate::{
    sim::SIM_GROUP_LABEL,
    wait::{Background, applied},
};

/// What the fake agent answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    Succeed,
    Fail,
    /// Not carried out yet: the request waits until the answer changes and
    /// the node is written again (see [`FakeAgent::release`]).
    Hold,
}

/// What the agent was asked to do, for assertions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    Reset { id: String, gpus: Vec<String> },
    Reboot { id: String },
}

#[derive(Clone)]
pub struct FakeAgent {
    pub reset: Arc<Mutex<Answer>>,
    pub reboot: Arc<Mutex<Answer>>,
    /// Every request carried out, in order. The agent never carries out the
    /// same id twice, as the real one must not.
    pub carried_out: Arc<Mutex<Vec<Request>>>,
    /// Every distinct request annotation seen, as (node, value): a request
    /// written twice (even with the same id) shows up twice.
    pub seen: Arc<Mutex<BTreeSet<(String, String)>>>,
}

impl Default for FakeAgent {
    fn default() -> Self {
        FakeAgent {
            reset: Arc::new(Mutex::new(Answer::Succeed)),
            reboot: Arc::new(Mutex::new(Answer::Succeed)),
            carried_out: Arc::new(Mutex::new(Vec::new())),
            seen: Arc::default(),
        }
    }
}

/// Writes `report` on `node`, stamped now.
pub async fn write_report(client: &Client, node: &str, mut report: GpuReport) -> kube::Result<()> {
    report.observed_at = Time(Timestamp::now());
    let patch =
        json!({"metadata": {"annotations": {GPU_REPORT_ANNOTATION: report.to_annotation()}}});
    Api::<Node>::all(client.clone())
        .patch(node, &PatchParams::default(), &Patch::Merge(patch))
        .await?;
    Ok(())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl FakeAgent {
    /// Held requests on `node` are carried out from now on, successfully:
    /// the node is written so that the agent looks at it again.
    pub async fn release(&self, client: &Client, node: &str) -> kube::Result<()> {
        *lock(&self.reset) = Answer::Succeed;
        *lock(&self.reboot) = Answer::Succeed;
        let nudge = Timestamp::now().to_string();
        let patch = json!({"metadata": {"annotations": {"gpuhealth-e2e/nudged-at": nudge}}});
        Api::<Node>::all(client.clone())
            .patch(node, &PatchParams::default(), &Patch::Merge(patch))
            .await?;
        Ok(())
    }

    pub fn requests(&self) -> Vec<Request> {
        lock(&self.carried_out).clone()
    }

    /// The request annotations written on `node`, each distinct value once.
    pub fn requests_written(&self, node: &str) -> Vec<String> {
        lock(&self.seen)
            .iter()
            .filter(|(n, _)| n == node)
            .map(|(_, v)| v.clone())
            .collect()
    }

    /// Serves every node of simulation group `group` until the handle is dropped.
    pub fn spawn(&self, client: Client, group: &str) -> Background {
        let agent = self.clone();
        let nodes: Api<Node> = Api::all(client.clone());
        let config = watcher::Config::default().labels(&format!("{SIM_GROUP_LABEL}={group}"));
        Background::spawn(async move {
            // `node/id`: a request id is unique per node (each agent journals its
            // own), not across the fleet; two nodes may well share one.
            let mut seen = BTreeSet::new();
            let mut stream = std::pin::pin!(applied(nodes, config));
            while let Some(node) = stream.next().await {
                if let Err(e) = agent.serve(&client, &node, &mut seen).await {
                    eprintln!("fake agent: {e}");
                }
            }
        })
    }

    async fn serve(
        &self,
        client: &Client,
        node: &Node,
        seen: &mut BTreeSet<String>,
    ) -> kube::Result<()> {
        let annotations = node.annotations();
        let name = node.name_any();
        for key in [RESET_REQUEST_ANNOTATION, REBOOT_REQUEST_ANNOTATION] {
            if let Some(value) = annotations.get(key) {
                lock(&self.seen).insert((name.clone(), value.clone()));
            }
        }
        if let Some(req) = annotations
            .get(RESET_REQUEST_ANNOTATION)
            .and_then(|v| ResetRequest::parse(v).ok())
            && *lock(&self.reset) != Answer::Hold
            && seen.insert(format!("{name}/{}", req.id))
        {
            lock(&self.carried_out).push(Request::Reset {
                id: req.id.to_string(),
                gpus: req.gpus.clone(),
            });
            let ok = *lock(&self.reset) == Answer::Succeed;
            if ok {
                heal(client, node).await?;
            }
            answer(
                client,
                &name,
                &req.id.to_string(),
                ok,
                "nvidia-smi --gpu-reset",
            )
            .await?;
        }
        if let Some(req) = annotations
            .get(REBOOT_REQUEST_ANNOTATION)
            .and_then(|v| RebootRequest::parse(v).ok())
            && *lock(&self.reboot) != Answer::Hold
            && seen.insert(format!("{name}/{}", req.id))
        {
            lock(&self.carried_out).push(Request::Reboot {
                id: req.id.to_string(),
            });
            let ok = *lock(&self.reboot) == Answer::Succeed;
            if ok {
                let boot = format!("boot-{}", Timestamp::now().as_millisecond());
                let status = json!({"status": {"nodeInfo": {"bootID": boot}}});
                Api::<Node>::all(client.clone())
                    .patch_status(&name, &PatchParams::default(), &Patch::Merge(status))
                    .await?;
                heal(client, node).await?;
            }
            answer(client, &name, &req.id.to_string(), ok, "reboot").await?;
        }
        Ok(())
    }
}

/// A fresh report with every GPU healthy.
async fn heal(client: &Client, node: &Node) -> kube::Result<()> {
    let report = node
        .annotations()
        .get(GPU_REPORT_ANNOTATION)
        .and_then(|v| GpuReport::parse(v).ok());
    if let Some(mut report) = report {
        for gpu in &mut report.gpus {
            gpu.health = GpuHealth::Healthy;
            gpu.recovery_action = Some(0);
            // A reset or reboot applies the row remaps pending.
            if let Some(rows) = &mut gpu.remapped_rows {
                rows.pending = false;
            }
        }
        write_report(client, &node.name_any(), report).await?;
    }
    Ok(())
}

async fn answer(client: &Client, node: &str, id: &str, ok: bool, what: &str) -> kube::Result<()> {
    let result = RequestResult {
        id: id
            .parse()
            .map_err(|e: String| kube::Error::Service(e.into()))?,
        outcome: if ok {
            Outcome::Succeeded
        } else {
            Outcome::Failed
        },
        message: if ok {
            format!("{what} succeeded")
        } else {
            format!("{what} failed (simulated)")
        },
        finished_at: Time(Timestamp::now()),
        diagnostics: None,
    };
    let patch =
        json!({"metadata": {"annotations": {REQUEST_RESULT_ANNOTATION: result.to_annotation()}}});
    Api::<Node>::all(client.clone())
        .patch(node, &PatchParams::default(), &Patch::Merge(patch))
        .await?;
    Ok(())
}
