//! The peer: Medik8s Node Healthcheck (NHC), the remediation operator a GPU
//! fleet would otherwise run, built from its source by `make peer-nhc` and
//! started out of cluster by its recipe's own script, against the same API
//! server and reacting to the same node condition as gpuhealth. Its first
//! action on a node is the remediation object it creates from the recipe's
//! stand-in template (`GpuRemediation/<node>`): no remediator acts on it, so
//! its figures are detection and reaction, which is what is compared.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use futures::StreamExt;
use gpuhealth_e2e::{
    cluster::kubectl,
    process::Process,
    sim::SIM_GROUP_LABEL,
    wait::{Background, events},
};
use kube::{
    Api, Client, ResourceExt,
    api::{ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams},
    runtime::watcher,
};
use serde_json::json;

use crate::{
    Result,
    fleet::GROUP,
    watch::{CONDITION, first_after},
};

/// Where the peer's template makes its remediation objects.
const NAMESPACE: &str = "nhc-bench";
const NHC_NAME: &str = "bench-nhc";
/// The account the bench reads the peer's `/metrics` as.
const METRICS_READER: &str = "bench-metrics-reader";
/// The label that splits the fleet's sick nodes between the two tools:
/// each leaves the other's alone, and both select the rest of the fleet.
pub const SIDE_LABEL: &str = "bench.gpuhealth.io/side";

/// The peer's build and recipe, where `make peer-nhc` put them.
#[derive(Clone, Debug)]
pub struct Nhc {
    /// Its checkout: `recipe/` and `source/config/crd/bases/`.
    pub dir: PathBuf,
    /// The manager, built from `source/`.
    pub bin: PathBuf,
}

impl Nhc {
    /// The peer named by `--nhc-dir` and `--nhc-bin`, or why it cannot run.
    pub fn find(dir: Option<&Path>, bin: Option<&Path>) -> Result<Nhc, String> {
        let (Some(dir), Some(bin)) = (dir, bin) else {
            return Err(
                "no peer given: --nhc-dir and --nhc-bin (make bench passes the ones `make peer-nhc` builds)"
                    .into(),
            );
        };
        for needed in [dir.join("recipe/run-nhc.sh"), bin.to_owned()] {
            if !needed.exists() {
                return Err(format!("{} does not exist", needed.display()));
            }
        }
        Ok(Nhc {
            dir: dir.to_owned(),
            bin: bin.to_owned(),
        })
    }

    /// Its CRD and the recipe's remediation kinds and template, once.
    pub async fn install(&self) -> Result<()> {
        let crd = self
            .dir
            .join("source/config/crd/bases/remediation.medik8s.io_nodehealthchecks.yaml");
        let recipe = self.dir.join("recipe");
        for file in [crd, recipe.join("00-gpuremediation-crds.yaml")] {
            kubectl(&["apply", "--server-side", "-f", &file.to_string_lossy()]).await?;
        }
        kubectl(&[
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/nodehealthchecks.remediation.medik8s.io",
            "crd/gpuremediations.bench.gpuhealth.io",
            "crd/gpuremediationtemplates.bench.gpuhealth.io",
        ])
        .await?;
        let template = recipe.join("10-template.yaml");
        kubectl(&["apply", "--server-side", "-f", &template.to_string_lossy()]).await?;
        // Its /metrics takes a bearer token that may read it (with no
        // serving certificate of a cluster's, it serves HTTPS, self-signed,
        // and asks the API server about each token).
        let account = format!("{NAMESPACE}:{METRICS_READER}");
        kubectl(&["create", "serviceaccount", METRICS_READER, "-n", NAMESPACE]).await?;
        kubectl(&[
            "create",
            "clusterrole",
            METRICS_READER,
            "--verb=get",
            "--non-resource-url=/metrics",
        ])
        .await?;
        kubectl(&[
            "create",
            "clusterrolebinding",
            METRICS_READER,
            "--clusterrole",
            METRICS_READER,
            "--serviceaccount",
            &account,
        ])
        .await?;
        Ok(())
    }

    /// Starts the manager and its NodeHealthCheck over the bench fleet,
    /// less the nodes on gpuhealth's side; returns once it has counted them.
    pub async fn start(&self, client: &Client, selected: usize) -> Result<Running> {
        let tmp = PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../target/peers/nhc-tmp"
        ));
        std::fs::create_dir_all(&tmp)?;
        let process = Process::launch_peer(
            self.dir.join("recipe/run-nhc.sh"),
            "bench-nhc",
            "--metrics-bind-address",
            |cmd| {
                cmd.env("NHC_BIN", &self.bin).env("NHC_TMP", &tmp);
            },
        )
        .await?;
        let pid = process.pid().ok_or("the peer exited at start")?;
        let token = kubectl(&[
            "create",
            "token",
            METRICS_READER,
            "-n",
            NAMESPACE,
            "--duration=24h",
        ])
        .await?
        .trim()
        .to_owned();
        let api = health_checks(client);
        let nhc = json!({
            "apiVersion": "remediation.medik8s.io/v1alpha1",
            "kind": "NodeHealthCheck",
            "metadata": {"name": NHC_NAME},
            "spec": {
                "selector": {
                    "matchLabels": {SIM_GROUP_LABEL: GROUP},
                    "matchExpressions": [{"key": SIDE_LABEL, "operator": "NotIn", "values": [Side::Gpuhealth.label()]}],
                },
                // As gpuhealth's budget is left wide open for the
                // comparison, so is the peer's.
                "minHealthy": 0,
                "unhealthyConditions": [{"type": CONDITION, "status": "False", "duration": "0s"}],
                "remediationTemplate": {
                    "apiVersion": "bench.gpuhealth.io/v1alpha1",
                    "kind": "GpuRemediationTemplate",
                    "name": "gpu",
                    "namespace": NAMESPACE,
                },
            },
        });
        api.patch(
            NHC_NAME,
            &PatchParams::apply("gpuhealth-bench").force(),
            &Patch::Apply(nhc),
        )
        .await?;
        let counted = |n: &DynamicObject| {
            n.data["status"]["observedNodes"]
                .as_u64()
                .is_some_and(|o| o as usize >= selected)
        };
        let this = watcher::Config::default().fields(&format!("metadata.name={NHC_NAME}"));
        // It counts the fleet at the end of its first pass, which reads
        // every node's Lease at its client's 20 requests a second.
        let startup = STARTUP.max(Duration::from_millis(selected as u64 * 100));
        gpuhealth_e2e::wait::until_set(api, this, "the peer counting the fleet", startup, |s| {
            s.get(NHC_NAME).is_some_and(counted)
        })
        .await?;
        let running = Running {
            process,
            pid,
            token,
        };
        // Its metrics server may start listening a moment after its
        // controllers have counted the fleet (a make test run found the
        // port refused at the first look).
        let listening = std::time::Instant::now() + METRICS_LISTENING;
        while let Err(e) = running.scrape().await {
            if std::time::Instant::now() >= listening {
                return Err(e);
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        Ok(running)
    }
}

/// How long the peer may take to start and count a small fleet.
const STARTUP: Duration = Duration::from_secs(300);

/// How long after that its `/metrics` may take to answer.
const METRICS_LISTENING: Duration = Duration::from_secs(30);

/// Which tool a sick node is left to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Gpuhealth,
    Nhc,
}

impl Side {
    pub fn label(self) -> &'static str {
        match self {
            Side::Gpuhealth => "gpuhealth",
            Side::Nhc => "nhc",
        }
    }
}

/// The peer while it runs (killed if dropped); [`Running::stop`] deletes its
/// NodeHealthCheck too, and with it, by owner, any remediation object left.
pub struct Running {
    pub process: Process,
    pub pid: u32,
    token: String,
}

impl Running {
    /// The text of its `/metrics` (by curl: HTTPS, self-signed).
    pub async fn scrape(&self) -> Result<String> {
        let out = tokio::process::Command::new("curl")
            .args([
                "--silent",
                "--show-error",
                "--fail",
                "--insecure",
                "--max-time",
                "30",
            ])
            .arg("--header")
            .arg(format!("Authorization: Bearer {}", self.token))
            .arg(format!("https://{}/metrics", self.process.metrics))
            .output()
            .await?;
        if !out.status.success() {
            return Err(format!(
                "the peer's /metrics: curl {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )
            .into());
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    pub async fn stop(self, client: &Client) -> Result<()> {
        let api = health_checks(client);
        let _ = api.delete(NHC_NAME, &DeleteParams::default()).await;
        self.process.terminate().await?;
        Ok(())
    }
}

/// The peer's `NodeHealthCheck`s.
fn health_checks(client: &Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("remediation.medik8s.io", "v1alpha1", "NodeHealthCheck");
    let resource = ApiResource::from_gvk_with_plural(&gvk, "nodehealthchecks");
    Api::all_with(client.clone(), &resource)
}

/// The remediation objects the peer makes from the recipe's template.
fn remediation_objects(client: &Client) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("bench.gpuhealth.io", "v1alpha1", "GpuRemediation");
    let resource = ApiResource::from_gvk_with_plural(&gvk, "gpuremediations");
    Api::namespaced_with(client.clone(), NAMESPACE, &resource)
}

#[derive(Default)]
struct Seen {
    /// When each node's remediation object was seen created.
    created: HashMap<String, Vec<Instant>>,
    /// Those that exist now.
    present: HashMap<String, String>,
}

/// The peer's first actions, as a watch on its remediation objects sees
/// them: created (a new uid under a node's name) and gone.
#[derive(Clone, Default)]
pub struct Remediations(Arc<Mutex<Seen>>);

impl Remediations {
    /// Records until the handle is dropped.
    pub fn watch(&self, client: &Client) -> Background {
        let api = remediation_objects(client);
        let seen = self.0.clone();
        Background::spawn(async move {
            let mut stream = std::pin::pin!(events(api, watcher::Config::default()));
            while let Some(event) = stream.next().await {
                let now = Instant::now();
                let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
                match event {
                    watcher::Event::Apply(o) | watcher::Event::InitApply(o) => {
                        let uid = o.uid().unwrap_or_default();
                        if seen.present.get(&o.name_any()) != Some(&uid) {
                            seen.created.entry(o.name_any()).or_default().push(now);
                            seen.present.insert(o.name_any(), uid);
                        }
                    }
                    watcher::Event::Delete(o) => {
                        seen.present.remove(&o.name_any());
                    }
                    watcher::Event::Init | watcher::Event::InitDone => {}
                }
            }
        })
    }

    /// The first remediation object for `node` seen created after `since`.
    pub fn after(&self, node: &str, since: Instant) -> Option<Instant> {
        let seen = self.0.lock().unwrap_or_else(|e| e.into_inner());
        first_after(&seen.created, node, since)
    }

    /// Whether `node` has a remediation object now.
    pub fn present(&self, node: &str) -> bool {
        let seen = self.0.lock().unwrap_or_else(|e| e.into_inner());
        seen.present.contains_key(node)
    }
}
