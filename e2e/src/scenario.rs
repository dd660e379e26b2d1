//! A remediation scenario on the real API server: simulated GPU nodes with a
//! vLLM-like Deployment, healthy GPU reports, a policy of the scenario's own,
//! the fake agent and the operator binary. One scenario runs at a time in a
//! test process (each starts its own operator, which manages every node).

use std::time::Duration;

use gpuhealth_api::{
    GpuHealthPolicy, GpuHealthPolicySpec, GpuNodeHealth, node_health::GpuNodeHealthStatus,
    vocabulary::IncidentOutcome,
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
    api::{ListParams, PostParams},
    runtime::watcher,
};
use tokio::sync::{Mutex, MutexGuard};

use crate::{
    Result,
    agent::{FakeAgent, write_report},
    client, crds, dra,
    kubelet::Kubelet,
    node_agent::{self, hardware, set_hardware},
    operator,
    process::Process,
    reports,
    sim::{
        GpuNodeSpec, SIM_GROUP_LABEL, cpu_node, gpu_deployment, gpu_node,
        gpu_operator_runtime_class, node_is_ready,
    },
    unique,
    wait::{Background, until, until_set},
};
use gpuhealth_agent::fake::{SimHardware, SimOutcome};
use gpuhealth_api::contract::{AnnotationValue, GPU_REPORT_ANNOTATION, GpuReport};

pub use crate::wait::WAIT;

static ONE_AT_A_TIME: Mutex<()> = Mutex::const_new(());

pub struct Scenario {
    pub client: Client,
    pub group: String,
    pub namespace: String,
    pub nodes: Vec<String>,
    pub policy: String,
    pub agent: FakeAgent,
    agent_task: Option<Background>,
    /// The real agent binaries (fake backend), one per node, when the
    /// scenario runs them instead of the in-process fake agent.
    agents: Vec<Process>,
    pub operator: Option<Process>,
    /// How [`Scenario::start`] and its variants start the operator.
    pub operator_options: operator::Options,
    _kubelet: Option<Background>,
    _turn: MutexGuard<'static, ()>,
}

impl Scenario {
    /// `nodes` eight-GPU nodes, each running eight one-GPU pods, reported
    /// healthy; the policy is `spec` with its selector set to these nodes.
    /// The operator is not started yet: see [`Scenario::start`].
    pub async fn new(name: &str, nodes: usize, spec: GpuHealthPolicySpec) -> Result<Scenario> {
        Scenario::new_with(name, nodes, spec, |_| {}, None).await
    }

    /// Like [`Scenario::new`], with the vLLM Deployment changed by
    /// `customize` before it is created, and `kubelet` starting its pods
    /// where the template takes them away from KWOK.
    pub async fn new_with(
        name: &str,
        nodes: usize,
        spec: GpuHealthPolicySpec,
        customize: impl FnOnce(&mut Deployment),
        kubelet: Option<&Kubelet>,
    ) -> Result<Scenario> {
        let mut scenario = Scenario::nodes(name, nodes, &GpuNodeSpec::default()).await?;
        scenario._kubelet = kubelet.map(|k| k.spawn(scenario.client.clone(), &scenario.namespace));
        let deployments: Api<Deployment> =
            Api::namespaced(scenario.client.clone(), &scenario.namespace);
        let mut vllm = gpu_deployment(
            &scenario.namespace,
            "vllm",
            &scenario.group,
            (nodes * 8) as i32,
            1,
        );
        customize(&mut vllm);
        let replicas = vllm.spec.as_ref().and_then(|s| s.replicas).unwrap_or(1);
        deployments.create(&PostParams::default(), &vllm).await?;
        until(deployments, "vllm", WAIT, |d| {
            d.status.as_ref().and_then(|s| s.ready_replicas) == Some(replicas)
        })
        .await?;
        for n in scenario.nodes.clone() {
            scenario.report_healthy(&n).await?;
        }
        scenario.with_policy(spec).await
    }

    /// `nodes` eight-GPU nodes of a DRA cluster: no device plugin, the
    /// GPUs published as a DRA driver's devices (one ResourceSlice per
    /// node), no pods yet (see [`crate::dra::claiming_pod`]), reported
    /// healthy; the policy is `spec` with its selector set to these nodes.
    pub async fn new_dra(name: &str, nodes: usize, spec: GpuHealthPolicySpec) -> Result<Scenario> {
        let node_spec = GpuNodeSpec {
            device_plugin: false,
            ..GpuNodeSpec::default()
        };
        let scenario = Scenario::nodes(name, nodes, &node_spec).await?;
        dra::ensure_device_class(&scenario.client).await?;
        let report = reports::healthy(&scenario.namespace, &[]);
        for n in &scenario.nodes {
            dra::publish(&scenario.client, n, &report).await?;
            write_report(&scenario.client, n, report.clone()).await?;
        }
        scenario.with_policy(spec).await
    }

    /// Publishes every node's GPUs as a DRA driver's devices too (a
    /// ResourceSlice each, the UUIDs of the nodes' reports): a bad GPU can
    /// then be fenced alone.
    pub async fn publish_devices(&self) -> Result<()> {
        dra::ensure_device_class(&self.client).await?;
        let report = reports::healthy(&self.namespace, &[]);
        for n in &self.nodes {
            dra::publish(&self.client, n, &report).await?;
        }
        Ok(())
    }

    /// The scenario's nodes, Ready, and its namespace; nothing else yet.
    async fn nodes(name: &str, nodes: usize, node_spec: &GpuNodeSpec) -> Result<Scenario> {
        let turn = ONE_AT_A_TIME.lock().await;
        let client = client().await?;
        crds::install(&client).await?;
        let group = unique(name);
        let node_api: Api<Node> = Api::all(client.clone());
        let names: Vec<String> = (0..nodes).map(|i| format!("{group}-{i}")).collect();
        for n in &names {
            node_api
                .create(&PostParams::default(), &gpu_node(n, &group, node_spec))
                .await?;
        }
        let selector = watcher::Config::default().labels(&format!("{SIM_GROUP_LABEL}={group}"));
        until_set(node_api, selector, "scenario nodes Ready", WAIT, |set| {
            set.len() == nodes && set.values().all(node_is_ready)
        })
        .await?;
        let namespace = group.clone();
        let ns = Namespace {
            metadata: ObjectMeta {
                name: Some(namespace.clone()),
                ..Default::default()
            },
            ..Default::default()
        };
        Api::<Namespace>::all(client.clone())
            .create(&PostParams::default(), &ns)
            .await?;
        Ok(Scenario {
            client,
            group: group.clone(),
            namespace,
            nodes: names,
            policy: group,
            agent: FakeAgent::default(),
            agent_task: None,
            agents: Vec::new(),
            operator: None,
            operator_options: operator::Options::default(),
            _kubelet: None,
            _turn: turn,
        })
    }

    /// Creates the scenario's policy: `spec`, selecting its nodes.
    async fn with_policy(self, mut spec: GpuHealthPolicySpec) -> Result<Scenario> {
        spec.node_selector = LabelSelector {
            match_labels: Some([(SIM_GROUP_LABEL.to_owned(), self.group.clone())].into()),
            ..Default::default()
        };
        // Outranks any policy other tests left behind.
        spec.priority = 1000;
        Api::<GpuHealthPolicy>::all(self.client.clone())
            .create(
                &PostParams::default(),
                &GpuHealthPolicy::new(&self.policy, spec),
            )
            .await?;
        Ok(self)
    }

    /// For a test of an install: one GPU node, a CPU node beside it where
    /// the operator's pods may go (never on a GPU node), the GPU Operator's
    /// `nvidia` RuntimeClass the agent's pods ask for, and no cooldown
    /// between incidents (such a test runs two). With the CPU node's name.
    pub async fn for_an_install(name: &str) -> Result<(Scenario, String)> {
        let mut spec = Scenario::quick_spec();
        spec.remediation_limits.cooldown = gpuhealth_api::Duration::from_secs(0);
        let s = Scenario::new(name, 1, spec).await?;
        let cpu = format!("{}-cpu", s.group);
        Api::<Node>::all(s.client.clone())
            .create(&PostParams::default(), &cpu_node(&cpu, &s.group))
            .await?;
        gpu_operator_runtime_class(&s.client).await?;
        Ok((s, cpu))
    }

    /// A policy spec with the defaults, verified quickly.
    pub fn quick_spec() -> GpuHealthPolicySpec {
        let mut spec = GpuHealthPolicySpec::for_selector(LabelSelector::default());
        spec.verification.stable_for = gpuhealth_api::Duration::from_secs(3);
        spec
    }

    /// Starts the fake agent and the operator, and waits until the operator
    /// has taken in every node.
    pub async fn start(&mut self) -> Result<()> {
        self.start_agent();
        self.start_operator().await
    }

    /// Starts the operator alone: the scenario's test is the node's
    /// detector and executor.
    pub async fn start_operator(&mut self) -> Result<()> {
        self.operator = Some(
            operator::start_with(
                &format!("operator-{}", self.group),
                self.operator_options.clone(),
            )
            .await?,
        );
        self.wait_taken_in().await
    }

    /// Like [`Scenario::start`], with the real `gpuhealth-agent` binary (fake
    /// backend) on every node instead of the in-process fake agent: each
    /// node's hardware is what its report said.
    pub async fn start_with_agent_binaries(&mut self) -> Result<()> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        for n in self.nodes.clone() {
            let pods = self.pods_on(&n).await?;
            let hardware = SimHardware {
                gpus: reports::healthy(&self.namespace, &pods).gpus,
                reset: SimOutcome::Succeed,
                reboot: SimOutcome::Succeed,
                reset_takes: None,
                executed: Vec::new(),
                capabilities: None,
            };
            set_hardware(&self.client, &n, &hardware).await?;
            let state = agent_state_dir(&n);
            let _ = std::fs::remove_dir_all(&state);
            self.agents
                .push(node_agent::start(&format!("{n}-agent"), &n, &state, None).await?);
            until(nodes.clone(), &n, WAIT, |node| {
                node.annotations()
                    .get(GPU_REPORT_ANNOTATION)
                    .and_then(|v| GpuReport::parse(v).ok())
                    .is_some_and(|r| r.source.as_deref() == Some("gpuhealth-agent/fake"))
            })
            .await?;
        }
        self.operator = Some(
            operator::start_with(
                &format!("operator-{}", self.group),
                self.operator_options.clone(),
            )
            .await?,
        );
        self.wait_taken_in().await
    }

    /// Replaces the agent binaries started by
    /// [`Scenario::start_with_agent_binaries`] by `binary` (this build when
    /// None), one node at a time as a DaemonSet's rolling update does: the
    /// old one sent SIGTERM and waited for, the new one started on the same
    /// state directory (its journal of requests).
    pub async fn roll_agents_to(&mut self, binary: Option<&std::path::Path>) -> Result<()> {
        let suffix = if binary.is_some() { "-previous" } else { "" };
        for (node, agent) in self.nodes.iter().zip(self.agents.iter_mut()) {
            agent.terminate().await?;
            if agent.exited(Duration::from_secs(30)).await.is_err() {
                agent.kill().await;
            }
            let name = format!("{node}-agent{suffix}");
            *agent = node_agent::start_from(binary, &name, node, &agent_state_dir(node)).await?;
        }
        Ok(())
    }

    /// The agent binaries started by [`Scenario::start_with_agent_binaries`].
    pub fn agent_processes(&self) -> &[Process] {
        &self.agents
    }

    /// The request ids the simulated hardware of `node` carried out.
    pub async fn executed(&self, node: &str) -> Result<Vec<String>> {
        Ok(hardware(&self.node(node).await?)
            .map(|h| h.executed)
            .unwrap_or_default())
    }

    /// Starts the fake agent alone: for scenarios that run their own operators.
    pub fn start_agent(&mut self) {
        self.agent_task = Some(self.agent.spawn(self.client.clone(), &self.group));
    }

    /// A PodDisruptionBudget over the scenario's vLLM pods, once the
    /// disruption controller has computed what it allows.
    pub async fn add_pdb(&self, name: &str, max_unavailable: i32) -> Result<()> {
        self.add_pdb_selecting(name, "vllm", max_unavailable).await
    }

    /// A PodDisruptionBudget over the pods labelled `app: <app>`, once the
    /// disruption controller has counted it.
    pub async fn add_pdb_selecting(
        &self,
        name: &str,
        app: &str,
        max_unavailable: i32,
    ) -> Result<()> {
        let pdb = PodDisruptionBudget {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            spec: Some(PodDisruptionBudgetSpec {
                max_unavailable: Some(IntOrString::Int(max_unavailable)),
                selector: Some(LabelSelector {
                    match_labels: Some([("app".into(), app.into())].into()),
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let api: Api<PodDisruptionBudget> = Api::namespaced(self.client.clone(), &self.namespace);
        api.create(&PostParams::default(), &pdb).await?;
        until(api, name, WAIT, |p| {
            p.status.as_ref().is_some_and(|s| {
                s.observed_generation.is_some() && s.disruptions_allowed == Some(max_unavailable)
            })
        })
        .await?;
        Ok(())
    }

    /// Waits until an operator has taken in every node.
    pub async fn wait_taken_in(&self) -> Result<()> {
        for n in self.nodes.clone() {
            self.wait_status(&n, "the operator takes the node in", |s| s.policy.is_some())
                .await?;
        }
        Ok(())
    }

    pub async fn pods_on(&self, node: &str) -> Result<Vec<String>> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), &self.namespace);
        let list = pods
            .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
            .await?;
        let mut names: Vec<String> = list
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .map(|p| p.name_any())
            .collect();
        names.sort();
        Ok(names)
    }

    pub async fn report_healthy(&self, node: &str) -> Result<()> {
        let pods = self.pods_on(node).await?;
        write_report(&self.client, node, reports::healthy(&self.namespace, &pods)).await?;
        Ok(())
    }

    /// GPU `gpu` of `node` gets the incident's Xid 119 and Xid 154.
    /// With agent binaries the hardware breaks and the agent reports it.
    pub async fn break_gpu(&self, node: &str, gpu: usize) -> Result<()> {
        let mut report = reports::healthy(&self.namespace, &self.pods_on(node).await?);
        if !self.agents.is_empty()
            && let Some(mut hw) = hardware(&self.node(node).await?)
        {
            report.gpus = hw.gpus;
            reports::xid_119_and_154(&mut report, gpu);
            hw.gpus = report.gpus;
            return set_hardware(&self.client, node, &hw).await;
        }
        reports::xid_119_and_154(&mut report, gpu);
        write_report(&self.client, node, report).await?;
        Ok(())
    }

    /// The node comes back from someone else's reboot (a provider's
    /// maintenance): a new boot id, and once the operator has seen it (the
    /// node is `Verifying`), a fresh report with every GPU healthy, as the
    /// agent would write on start.
    pub async fn rebooted_by_provider(&self, node: &str) -> Result<()> {
        let boot = format!(
            "boot-{}",
            k8s_openapi::jiff::Timestamp::now().as_millisecond()
        );
        let status = serde_json::json!({"status": {"nodeInfo": {"bootID": boot}}});
        Api::<Node>::all(self.client.clone())
            .patch_status(
                node,
                &kube::api::PatchParams::default(),
                &kube::api::Patch::Merge(status),
            )
            .await?;
        self.wait_status(node, "the new boot id seen", |st| {
            st.phase == gpuhealth_api::node_health::Phase::Verifying
        })
        .await?;
        self.report_healthy(node).await
    }

    /// Writes an arbitrary GPU report on `node`.
    pub async fn write_report(
        &self,
        node: &str,
        report: gpuhealth_api::contract::GpuReport,
    ) -> Result<()> {
        write_report(&self.client, node, report).await?;
        Ok(())
    }

    pub async fn wait_status(
        &self,
        node: &str,
        what: &str,
        done: impl Fn(&GpuNodeHealthStatus) -> bool,
    ) -> Result<GpuNodeHealthStatus> {
        let api: Api<GpuNodeHealth> = Api::all(self.client.clone());
        // The last status seen goes into a timeout's message: what the
        // node was doing instead is most of a failure's diagnosis.
        let last = std::sync::Mutex::new(None::<GpuNodeHealthStatus>);
        let g = until(api, node, WAIT, |g| {
            let status = g.status.as_ref();
            *last.lock().unwrap_or_else(|p| p.into_inner()) = status.cloned();
            status.is_some_and(&done)
        })
        .await
        .map_err(|e| {
            let seen = last.lock().unwrap_or_else(|p| p.into_inner()).take();
            crate::HarnessError::ClusterStart(format!("{what}: {e}; {}", last_seen(seen)))
        })?;
        Ok(g.status.unwrap_or_default())
    }

    /// Waits until `node` is Healthy with its latest incident recovered, and
    /// the operator has carried that out: the status is written before the
    /// uncordon, and the incident's `Recovered` Event is published after it.
    pub async fn wait_recovered(&self, node: &str) -> Result<GpuNodeHealthStatus> {
        let status = self
            .wait_status(node, "recovered", |st| {
                st.phase == gpuhealth_api::node_health::Phase::Healthy
                    && st
                        .history
                        .first()
                        .is_some_and(|i| i.outcome == Some(IncidentOutcome::Recovered))
            })
            .await?;
        let incident = status
            .history
            .first()
            .map(|i| i.id.clone())
            .unwrap_or_default();
        self.wait_event_saying(node, IncidentOutcome::Recovered.as_str(), &incident)
            .await?;
        Ok(status)
    }

    /// Waits until the workloads `node`'s latest incident evicted have been
    /// judged (Ready again or not): the end of the incident's work.
    pub async fn wait_workloads_judged(&self, node: &str) -> Result<GpuNodeHealthStatus> {
        self.wait_status(node, "the evicted workloads judged", |st| {
            st.history
                .first()
                .and_then(|i| i.workloads.as_ref())
                .is_some_and(|w| w.outcome.is_some())
        })
        .await
    }

    pub async fn node(&self, node: &str) -> Result<Node> {
        Ok(Api::<Node>::all(self.client.clone()).get(node).await?)
    }

    /// Waits until an Event with `reason` about the object `name` exists.
    pub async fn wait_event(&self, name: &str, reason: &str) -> Result<()> {
        self.wait_event_saying(name, reason, "").await
    }

    /// Waits until an Event with `reason` about `name` whose message contains `text` exists.
    pub async fn wait_event_saying(&self, name: &str, reason: &str, text: &str) -> Result<()> {
        crate::wait::event_saying(&self.client, name, reason, text).await
    }
}

/// Where the agent binary of `node` keeps its journal.
fn agent_state_dir(node: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("gpuhealth-agent-{node}"))
}

/// A status as a timeout names it: its phase, reason and message.
fn last_seen(status: Option<GpuNodeHealthStatus>) -> String {
    match status {
        None => "no status seen".to_owned(),
        Some(s) => format!(
            "last seen {:?} ({}): {}",
            s.phase,
            s.reason.map(|r| r.as_str()).unwrap_or("no reason"),
            s.message.unwrap_or_default()
        ),
    }
}
