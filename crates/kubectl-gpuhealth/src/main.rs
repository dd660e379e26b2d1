//! kubectl-gpuhealth: the kubectl plugin (`kubectl gpuhealth ...`).
//!
//! - `status`: policies, nodes per phase, unhealthy nodes, bad GPUs and
//!   the pods on them, findings.
//! - `explain NODE`: the node's story from its first signal to now, and
//!   what to do next.
//! - `probe-check TARGET`: a workload's startup window against its observed
//!   cold starts, with the probe timing to paste when it is too short.
//! - `pods-on-gpu NODE GPU`: the pods holding a GPU.
//!
//! Each module builds a serialisable answer and renders it without a
//! cluster; this file does the reading. `-o json|yaml` prints the answer.

mod explain;
mod output;
mod pods_on_gpu;
mod probe_check;
mod status;

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use gpuhealth_api::{
    GpuHealthPolicy, GpuNodeHealth,
    contract::{AnnotationValue, GPU_REPORT_ANNOTATION, GpuReport},
};
use k8s_openapi::{
    api::{
        apps::v1::{Deployment, ReplicaSet, StatefulSet},
        core::v1::{Event, Node, Pod},
        events::v1::Event as EventsV1Event,
    },
    jiff::Timestamp,
};
use kube::{Api, Client, ResourceExt, api::ListParams};

use crate::{
    explain::{ExplainInput, NodeEvent},
    output::{Output, Style, emit},
    probe_check::{PodInput, Target},
};

/// Inspect gpuhealth: the fleet, a node's timeline, a workload's probes.
#[derive(Debug, Parser)]
#[command(name = "kubectl-gpuhealth", version, about, long_about = None)]
struct Args {
    /// Output format.
    #[arg(short, long, global = true, value_enum, default_value_t = Output::Text)]
    output: Output,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Policies and node health at a glance.
    Status,
    /// A node's timeline: signals, decisions, actions, outcome, and what to do next.
    Explain {
        /// The node.
        node: String,
    },
    /// Compare a workload's startup probe window with its observed cold starts.
    ProbeCheck {
        /// `POD`, `pod/NAME`, `deploy/NAME`, `sts/NAME` or `rs/NAME`
        /// (`deployment/`, `statefulset/`, `replicaset/` and plurals too).
        target: String,
        /// The namespace; else the kubeconfig context's, else `default`.
        #[arg(short, long)]
        namespace: Option<String>,
    },
    /// The pods holding a GPU of a node, from the agent's report.
    PodsOnGpu {
        node: String,
        /// GPU UUID, index, or PCI bus id.
        gpu: String,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let args = Args::parse();
    let out = args.output;
    let result = match &args.command {
        Command::Status => status(out).await,
        Command::Explain { node } => explain(node, out).await,
        Command::ProbeCheck { target, namespace } => {
            probe_check(target, namespace.as_deref(), out).await
        }
        Command::PodsOnGpu { node, gpu } => pods_on_gpu(node, gpu, out).await,
    };
    match result {
        Ok(out) => {
            print!("{out}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kubectl-gpuhealth: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn connect() -> Result<Client, String> {
    Client::try_default()
        .await
        .map_err(|e| format!("connecting to the cluster: {e}"))
}

fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

/// A failed read, with `what` named; a 404 says "not found" plainly.
fn read_error(what: &str) -> impl Fn(kube::Error) -> String + '_ {
    move |e| {
        if is_not_found(&e) {
            format!("{what} not found")
        } else {
            format!("{what}: {e}")
        }
    }
}

async fn status(output: Output) -> Result<String, String> {
    let client = connect().await?;
    let crds = |e: kube::Error| {
        if is_not_found(&e) {
            "the gpuhealth CRDs are not installed in this cluster (kubectl apply -k config/)".into()
        } else {
            e.to_string()
        }
    };
    let policies = Api::<GpuHealthPolicy>::all(client.clone())
        .list(&ListParams::default())
        .await
        .map_err(crds)?
        .items;
    let nodes = Api::<GpuNodeHealth>::all(client)
        .list(&ListParams::default())
        .await
        .map_err(crds)?
        .items;
    let fleet = status::build(&policies, &nodes);
    emit(output, &fleet, || {
        status::text(&fleet, Timestamp::now(), Style::for_stdout())
    })
}

async fn explain(node: &str, output: Output) -> Result<String, String> {
    let client = connect().await?;
    let health = Api::<GpuNodeHealth>::all(client.clone())
        .get(node)
        .await
        .map_err(|e| {
            if is_not_found(&e) {
                format!(
                    "node {node} is not managed by any GpuHealthPolicy, or does not exist: there is no GpuNodeHealth {node} (kubectl get gnh lists the managed nodes)"
                )
            } else {
                format!("GpuNodeHealth {node}: {e}")
            }
        })?;
    let status = health.status.unwrap_or_default();
    let (report, found) = match Api::<Node>::all(client.clone()).get(node).await {
        Ok(n) => {
            let report = match n.annotations().get(GPU_REPORT_ANNOTATION) {
                Some(raw) => GpuReport::parse(raw).map_err(|e| e.to_string()),
                None => Err(format!(
                    "node {node} has no {GPU_REPORT_ANNOTATION} report: is gpuhealth-agent running there?"
                )),
            };
            (report, Some(n))
        }
        Err(e) => (Err(read_error(&format!("node {node}"))(e)), None),
    };
    // Only to name what each Xid asks for as the operator saw it: a policy
    // that cannot be read leaves the built-in table.
    let xid_overrides = match &status.policy {
        Some(p) => Api::<GpuHealthPolicy>::all(client.clone())
            .get(p)
            .await
            .map(|p| p.spec.detection.xid_overrides)
            .unwrap_or_default(),
        None => Vec::new(),
    };
    let events = node_events(&client, node).await?;
    let node_object = found.map(|n| {
        let created = n.metadata.creation_timestamp.as_ref().map(|t| t.0);
        (n.uid().unwrap_or_default(), created)
    });
    let input = ExplainInput {
        node: node.to_owned(),
        status,
        report,
        events,
        node_object,
        xid_overrides,
    };
    let now = Timestamp::now();
    emit(output, &explain::explanation(&input, now), || {
        explain::render(&input, now, Style::for_stdout())
    })
}

/// The Events about a node, in every namespace (the operator's Recorder
/// files a Node's under `default`). core/v1 shows events.k8s.io/v1 Events
/// too, as the e2e suite reads them; events.k8s.io/v1 is the fallback for
/// a user allowed only that API.
async fn node_events(client: &Client, node: &str) -> Result<Vec<NodeEvent>, String> {
    let core = ListParams::default().fields(&format!(
        "involvedObject.kind=Node,involvedObject.name={node}"
    ));
    match Api::<Event>::all(client.clone()).list(&core).await {
        Ok(list) => Ok(list.items.iter().filter_map(NodeEvent::from_core).collect()),
        Err(core_error) => {
            let v1 =
                ListParams::default().fields(&format!("regarding.kind=Node,regarding.name={node}"));
            Api::<EventsV1Event>::all(client.clone())
                .list(&v1)
                .await
                .map(|list| {
                    list.items
                        .iter()
                        .filter_map(NodeEvent::from_events_v1)
                        .collect()
                })
                .map_err(|e| format!("Events about node {node}: {core_error}; events.k8s.io: {e}"))
        }
    }
}

async fn probe_check(
    target: &str,
    namespace: Option<&str>,
    output: Output,
) -> Result<String, String> {
    let target = Target::parse(target)?;
    let client = connect().await?;
    let ns = namespace.map_or_else(|| client.default_namespace().to_owned(), str::to_owned);
    let what = format!("{target} in namespace {ns}");
    let pods_api: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let by_labels = |query: String| {
        let pods_api = pods_api.clone();
        let what = what.clone();
        async move {
            pods_api
                .list(&ListParams::default().labels(&query))
                .await
                .map(|l| l.items)
                .map_err(|e| format!("pods of {what}: {e}"))
        }
    };
    let pods = match &target {
        Target::Pod(name) => {
            let pod = pods_api.get(name).await.map_err(read_error(&what))?;
            let all = pods_api
                .list(&ListParams::default())
                .await
                .map_err(|e| format!("pods in namespace {ns}: {e}"))?
                .items;
            probe_check::siblings(&pod, all)
        }
        Target::Deployment(name) => {
            let d = Api::<Deployment>::namespaced(client.clone(), &ns)
                .get(name)
                .await
                .map_err(read_error(&what))?;
            let selector = d.spec.as_ref().map(|s| &s.selector);
            by_labels(probe_check::label_query(&what, selector)?).await?
        }
        Target::StatefulSet(name) => {
            let s = Api::<StatefulSet>::namespaced(client.clone(), &ns)
                .get(name)
                .await
                .map_err(read_error(&what))?;
            let selector = s.spec.as_ref().map(|s| &s.selector);
            by_labels(probe_check::label_query(&what, selector)?).await?
        }
        Target::ReplicaSet(name) => {
            let r = Api::<ReplicaSet>::namespaced(client.clone(), &ns)
                .get(name)
                .await
                .map_err(read_error(&what))?;
            let selector = r.spec.as_ref().map(|s| &s.selector);
            by_labels(probe_check::label_query(&what, selector)?).await?
        }
    };

    let events_api: Api<Event> = Api::namespaced(client.clone(), &ns);
    let nodes_api: Api<Node> = Api::all(client);
    let mut reports: Vec<(String, Option<GpuReport>)> = Vec::new();
    let mut inputs = Vec::with_capacity(pods.len());
    for pod in pods {
        let name = pod.name_any();
        let fields = format!("involvedObject.kind=Pod,involvedObject.name={name}");
        let events = events_api
            .list(&ListParams::default().fields(&fields))
            .await
            .map_err(|e| format!("Events about pod {ns}/{name}: {e}"))?
            .items;
        // The Xids of its GPUs tell a GPU error from a probe kill; without
        // a readable report the check still runs on the rest.
        let node = pod.spec.as_ref().and_then(|s| s.node_name.clone());
        let mut xids = Vec::new();
        if let Some(node) = node {
            if !reports.iter().any(|(n, _)| *n == node) {
                let report = nodes_api.get(&node).await.ok().and_then(|n| {
                    n.annotations()
                        .get(GPU_REPORT_ANNOTATION)
                        .and_then(|raw| GpuReport::parse(raw).ok())
                });
                reports.push((node.clone(), report));
            }
            if let Some((_, Some(report))) = reports.iter().find(|(n, _)| *n == node) {
                xids = report.xids_of_pod(&ns, &name);
            }
        }
        inputs.push(PodInput { pod, events, xids });
    }
    let check = probe_check::check(&target.to_string(), &ns, &inputs);
    emit(output, &check, || {
        probe_check::text(&check, Style::for_stdout())
    })
}

async fn pods_on_gpu(node: &str, gpu: &str, output: Output) -> Result<String, String> {
    let client = connect().await?;
    let n = Api::<Node>::all(client.clone())
        .get(node)
        .await
        .map_err(|e| format!("node {node}: {e}"))?;
    let raw = n.annotations().get(GPU_REPORT_ANNOTATION).ok_or_else(|| {
        format!(
            "node {node} has no {GPU_REPORT_ANNOTATION} report: is gpuhealth-agent running there?"
        )
    })?;
    let report = GpuReport::parse(raw).map_err(|e| format!("node {node}: {e}"))?;
    let entry = pods_on_gpu::find(&report, gpu)?;
    let mut on_node: Vec<Pod> = Api::<Pod>::all(client)
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await
        .map_err(|e| format!("the pods on {node}: {e}"))?
        .items;
    on_node.retain(|p| p.metadata.deletion_timestamp.is_none());
    // The policy is not read here: a gang named by its own label shows
    // the mark a controller wrote, or none.
    let answer = pods_on_gpu::Answer::new(node, entry, &on_node, None);
    emit(output, &answer, || {
        pods_on_gpu::text(&answer, Timestamp::now(), Style::for_stdout())
    })
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::{Args, Command};

    #[test]
    fn flags_are_consistent() {
        Args::command().debug_assert();
    }

    #[test]
    fn probe_check_takes_a_namespace_and_output_goes_anywhere() {
        let args = Args::try_parse_from([
            "kubectl-gpuhealth",
            "probe-check",
            "deploy/vllm",
            "-n",
            "ml-serving",
            "-o",
            "json",
        ])
        .expect("parses");
        match args.command {
            Command::ProbeCheck { target, namespace } => {
                assert_eq!(target, "deploy/vllm");
                assert_eq!(namespace.as_deref(), Some("ml-serving"));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(args.output, super::Output::Json);
    }
}
