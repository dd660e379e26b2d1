//! gpuhealth-operator: watches the nodes that `GpuHealthPolicy` objects
//! select and takes each unhealthy one from first signal back to serving.

mod account;
mod actions;
mod api_client;
mod conditions;
mod context;
mod devices;
mod discovery;
mod error;
mod events;
mod failpoint;
mod fences;
mod gangs;
mod gone;
mod leader;
mod locks;
mod memory;
mod metrics;
mod observe;
mod pass;
mod pod_health;
mod policy_status;
mod protection;
mod reconcile;
mod retry;
mod seal;
mod selection;
mod slim;
mod takeover;
#[cfg(test)]
mod testing;
mod triggers;
mod validation;
mod watched_workloads;
mod watches;

use std::{net::SocketAddr, process::ExitCode, sync::Arc, time::Duration};

use clap::{Parser, ValueEnum};

use futures::{FutureExt, StreamExt};
use gpuhealth_api::GpuHealthPolicy;
use gpuhealth_engine::guardrails::{ConditionTypes, Guardrails};
use gpuhealth_http::api_requests::CountRequests;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::{
    Api, Config,
    runtime::{Controller, watcher},
};
use tracing::{error, info, warn};

use crate::{
    context::Context,
    leader::{Elector, Settings},
    metrics::Metrics,
};

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// The gpuhealth operator.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Args {
    /// Log format.
    #[arg(long, env = "GPUHEALTH_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// This replica's name, for Events and the leader Lease (from the downward API).
    #[arg(long, env = "POD_NAME", default_value = "gpuhealth-operator")]
    pod_name: String,
    /// Where to serve /metrics, /livez and /readyz.
    #[arg(long, env = "GPUHEALTH_METRICS_ADDR", default_value = "0.0.0.0:8080")]
    metrics_addr: SocketAddr,
    /// The operator's namespace (from the downward API): its leader Lease,
    /// and the Secret of its seal's key.
    #[arg(long, env = "POD_NAMESPACE", default_value = "default")]
    namespace: String,
    /// The Secret, in the operator's namespace, holding the key it seals
    /// its records with (made by the first replica that finds none).
    #[arg(
        long,
        env = "GPUHEALTH_SEAL_SECRET",
        default_value = "gpuhealth-operator-seal"
    )]
    seal_secret: String,
    /// Where validation pods run: a namespace of their own that enforces
    /// `restricted` Pod Security (config/validation).
    #[arg(
        long,
        env = "GPUHEALTH_VALIDATION_NAMESPACE",
        default_value = "gpuhealth-validation"
    )]
    validation_namespace: String,
    /// The ServiceAccount validation pods run as: no token, no permissions.
    #[arg(long, default_value = "gpuhealth-validation")]
    validation_service_account: String,
    /// The leader Lease's name: replicas with the same one elect one leader.
    #[arg(long, default_value = "gpuhealth-operator")]
    lease_name: String,
    /// How long a leader's claim holds without renewal; a new leader takes
    /// over this long after the last one stopped renewing.
    #[arg(long, default_value = "15s", value_parser = duration)]
    lease_duration: Duration,
    /// How long the leader keeps acting without a successful renewal; less
    /// than --lease-duration, so it stops before another may start.
    #[arg(long, default_value = "10s", value_parser = duration)]
    renew_deadline: Duration,
    /// How often to renew, or to try to take the lease.
    #[arg(long, default_value = "2s", value_parser = duration)]
    retry_period: Duration,
    /// How often the admission protection is checked (see
    /// docs/security.md): until a check finds it in force, nothing is
    /// enforced.
    #[arg(long, default_value = "2m", value_parser = duration)]
    admission_check_interval: Duration,
    /// Act without checking the admission protection: for a development
    /// cluster without the install's admission policies, never for one
    /// where anyone else may patch Nodes.
    #[arg(long, env = "GPUHEALTH_SKIP_ADMISSION_CHECK")]
    skip_admission_check: bool,
    /// Guardrail: namespaces no drain evicts from, whatever a policy says
    /// (the operator's own and the validation pods' always are).
    #[arg(
        long,
        env = "GPUHEALTH_NEVER_DRAIN_NAMESPACES",
        value_delimiter = ',',
        default_value = "kube-system"
    )]
    never_drain_namespaces: Vec<String>,
    /// Guardrail: the most nodes disrupted at once across all policies, a
    /// count or a percentage of every node a policy manages (never below one).
    #[arg(long, env = "GPUHEALTH_MAX_DISRUPTED_NODES", default_value = "10%", value_parser = int_or_percent)]
    max_disrupted_nodes: IntOrString,
    /// Guardrail: the most nodes a policy may select in Enforce before it
    /// must say acknowledgeFleetWide; 0: no bound.
    #[arg(long, env = "GPUHEALTH_FLEET_WIDE_NODES", default_value_t = 100)]
    fleet_wide_nodes: usize,
    /// Guardrail: the node condition types policies may act on
    /// (detection.nodeConditions); `*`: any. None by default.
    #[arg(long, env = "GPUHEALTH_CONDITION_TYPES", value_delimiter = ',')]
    condition_types: Vec<String>,
}

/// How long the stores a step reads may take to list before the wait says so.
const CACHES_LATE: Duration = Duration::from_secs(30);

fn int_or_percent(s: &str) -> Result<IntOrString, String> {
    match s.strip_suffix('%') {
        Some(p) => p
            .parse::<u8>()
            .ok()
            .filter(|p| *p <= 100)
            .map(|_| IntOrString::String(s.to_owned()))
            .ok_or_else(|| format!("{s:?} is not a percentage from 0% to 100%")),
        None => s
            .parse::<i32>()
            .ok()
            .filter(|n| *n >= 1)
            .map(IntOrString::Int)
            .ok_or_else(|| format!("{s:?} is neither a count of at least 1 nor a percentage")),
    }
}

/// The guardrails the flags set; an error for a condition type no
/// condition could have (the admission policy's guardrail is written from
/// the same value, into a CEL string).
fn guardrails(args: &Args) -> Result<Guardrails, String> {
    let mut never_drain: Vec<String> = args
        .never_drain_namespaces
        .iter()
        .filter(|n| !n.is_empty())
        .cloned()
        .collect();
    for own in [&args.namespace, &args.validation_namespace] {
        if !never_drain.contains(own) {
            never_drain.push(own.clone());
        }
    }
    let types: Vec<String> = args
        .condition_types
        .iter()
        .filter(|t| !t.is_empty())
        .cloned()
        .collect();
    let condition_type = |t: &str| {
        t == "*"
            || t.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/'))
    };
    if let Some(bad) = types.iter().find(|t| !condition_type(t)) {
        return Err(format!(
            "--condition-types: {bad:?} is not a node condition type (comma-separated, no spaces; `*`: any)"
        ));
    }
    Ok(Guardrails {
        never_drain,
        max_disrupted: args.max_disrupted_nodes.clone(),
        fleet_wide: (args.fleet_wide_nodes > 0).then_some(args.fleet_wide_nodes),
        condition_types: if types.iter().any(|t| t == "*") {
            ConditionTypes::Any
        } else {
            ConditionTypes::Only(types)
        },
    })
}

fn duration(s: &str) -> Result<Duration, String> {
    s.parse::<gpuhealth_api::Duration>()
        .map(|d| d.as_std())
        .map_err(|e| e.to_string())
}

#[derive(Debug, thiserror::Error)]
enum Fatal {
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
    #[error("flags: {0}")]
    Flags(String),
    #[error("serving metrics: {0}")]
    Metrics(std::io::Error),
    #[error("lost the leader Lease; exiting so that no two replicas act at once")]
    LostLeadership,
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,kube=warn"));
    // Colour only on a terminal: logs in files and collectors stay plain.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    init_tracing(args.log_format);
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!(error = %e, "gpuhealth-operator stopped");
            ExitCode::FAILURE
        }
    }
}

/// The operator, in order: its client and metrics endpoint; the records
/// every replica reads before it leads; the lease; once leading, the
/// seal's key, the fleet's watches and the other tools' locks; then the
/// nodes' and the policies' controllers until stopped or the lease is lost.
async fn run(args: Args) -> Result<(), Fatal> {
    let guardrails = guardrails(&args).map_err(Fatal::Flags)?;
    if !(args.retry_period < args.renew_deadline && args.renew_deadline < args.lease_duration) {
        return Err(Fatal::Flags(format!(
            "need --retry-period ({:?}) < --renew-deadline ({:?}) < --lease-duration ({:?})",
            args.retry_period, args.renew_deadline, args.lease_duration
        )));
    }
    let crash_after = failpoint::CrashAfter::from_env().map_err(Fatal::Flags)?;
    let metrics = Arc::new(Metrics::default());
    let client = client(&args, &metrics).await?;
    info!(
        version = env!("CARGO_PKG_VERSION"),
        "gpuhealth-operator starting"
    );
    serve_metrics(args.metrics_addr, metrics.clone()).await?;
    let records = watches::records(&client).await?;
    metrics
        .ready
        .store(true, std::sync::atomic::Ordering::Relaxed);

    let mut elector = Elector::new(client.clone(), lease_settings(&args));
    tokio::select! {
        () = elector.acquire() => {}
        () = shutdown_signal() => {
            info!("stopped before becoming the leader");
            return Ok(());
        }
    }
    metrics.leader.set(1);
    let (Some(health_changed), Some(spec_changes)) =
        (records.health_changes.lead(), records.spec_changes.lead())
    else {
        unreachable!("leadership is taken once");
    };
    let leadership = elector.leadership();
    let mut renewing = elector.renew_in_background();
    // The seal's key is read (or made, a write) only by the leader: no
    // replica writes without the lease.
    let seal = tokio::select! {
        seal = seal::Seal::load(&client, &args.namespace, &args.seal_secret) => seal,
        () = renewing.lost() => {
            metrics.leader.set(0);
            return Err(Fatal::LostLeadership);
        }
    };

    let locks = Arc::new(locks::Locks::default());
    // When a lock becomes unreadable or readable again, every policy's
    // `Ready` condition is looked at again.
    let (unreadable_changed, unreadable_changes) = futures::channel::mpsc::unbounded();
    // When the admission protection comes or goes, every node and policy
    // is looked at again.
    let protection = Arc::new(protection::Protection::new(!args.skip_admission_check));
    let (unprotected_nodes, protection_node_changes) = futures::channel::mpsc::unbounded();
    let (unprotected_policies, protection_policy_changes) = futures::channel::mpsc::unbounded();
    tokio::spawn(protection::watch(
        client.clone(),
        protection.clone(),
        metrics.clone(),
        args.admission_check_interval,
        guardrails.condition_types.clone(),
        vec![unprotected_nodes, unprotected_policies],
    ));
    tokio::spawn(locks::poll(
        client.clone(),
        records.policies.clone(),
        locks.clone(),
        unreadable_changed,
    ));
    let fleet = watches::fleet(&client, records.node_health.clone());
    // DRA: devices' taints and gpuhealth's DeviceTaintRules, where the
    // cluster serves them; a change reconciles the node concerned.
    let (device_changed, device_changes) = futures::channel::mpsc::unbounded();
    let dra = tokio::select! {
        dra = devices::watch(&client, device_changed.clone()) => dra,
        () = renewing.lost() => {
            metrics.leader.set(0);
            return Err(Fatal::LostLeadership);
        }
    };
    // The kubelet's health of the devices it gave each pod: a change
    // reconciles the pod's node.
    let pod_health = pod_health::watch(client.clone(), device_changed);
    let in_flight = Arc::new(pass::InFlight::default());
    let ctx = Arc::new(Context {
        client: client.clone(),
        in_flight: in_flight.clone(),
        nodes: fleet.nodes.clone(),
        policies: records.policies.clone(),
        node_health: records.node_health,
        gpu_tables: records.gpu_tables,
        budgets: fleet.budgets,
        dra,
        pod_health,
        memory: Default::default(),
        at_takeover: Default::default(),
        failures: Default::default(),
        honour_announced: Default::default(),
        locks,
        protection,
        guardrails,
        metrics: metrics.clone(),
        leadership,
        crash_after,
        validation: validation::Target {
            namespace: args.validation_namespace,
            service_account: args.validation_service_account,
        },
        events: events::Events::new(client.clone(), "gpuhealth-operator", &args.pod_name),
        seal,
    });
    // A policy's spec, or the protection coming or going, may change any
    // node's decision: a pass over every node, paced behind the nodes with
    // news. A node-health change only its own node's.
    let policy_api = Api::<GpuHealthPolicy>::all(client.clone());
    let every_node = futures::stream::select(spec_changes.nodes, protection_node_changes);
    let nodes_stream = fleet
        .controller
        .reconcile_on(pass::paced(every_node, fleet.nodes.clone(), in_flight))
        .reconcile_on(health_changed.nodes)
        .reconcile_on(fleet.budget_changes)
        .reconcile_on(device_changes)
        .shutdown_on_signal()
        .run(reconcile::reconcile, reconcile::error_policy, ctx.clone());
    // No decision before every store it reads has listed; waited for here,
    // beside the lease's renewals, not before them.
    let caches = ctx.clone();
    let node_loop = async move {
        if caches_ready(&caches).await? {
            nodes_stream.for_each(|_| futures::future::ready(())).await;
        }
        Ok::<(), Fatal>(())
    };
    // The records of deleted nodes, beside the nodes' reconciles.
    let swept = ctx.clone();
    let deletions = fleet.deletions;
    tokio::spawn(async move { gone::watch(&swept, deletions).await });
    // A policy's status follows its nodes' statuses, which nodes it selects,
    // and whether the locks it names can be read.
    let policy_loop = Controller::new(policy_api, watcher::Config::default())
        .reconcile_all_on(unreadable_changes)
        .reconcile_all_on(fleet.label_changes)
        .reconcile_all_on(protection_policy_changes)
        // Its own watch may bring a policy's change before the store that
        // counts every policy's share has it: all look again once it does.
        .reconcile_all_on(spec_changes.policies)
        .reconcile_on(health_changed.policies)
        .shutdown_on_signal()
        .run(policy_status::reconcile, policy_status::error_policy, ctx)
        .for_each(|_| futures::future::ready(()));

    tokio::select! {
        stopped = futures::future::try_join(node_loop, policy_loop.map(Ok)) => {
            renewing.release().await;
            stopped?;
            info!("gpuhealth-operator stopped");
            Ok(())
        }
        () = renewing.lost() => {
            metrics.leader.set(0);
            Err(Fatal::LostLeadership)
        }
    }
}

/// The API client: no retries of its own (a 429 from the Eviction API is a
/// PodDisruptionBudget's "not now", for the reconcile to requeue), this
/// replica named in every request (the audit log then says which replica
/// made each write, and whether it led then), and its requests counted.
async fn client(args: &Args, metrics: &Metrics) -> Result<kube::Client, Fatal> {
    let mut config = Config::infer().await.map_err(kube::Error::InferConfig)?;
    config.default_retry = false;
    let agent = format!(
        "gpuhealth-operator/{} ({})",
        env!("CARGO_PKG_VERSION"),
        args.pod_name
    );
    if let Ok(agent) = http::HeaderValue::from_str(&agent) {
        config.headers.push((http::header::USER_AGENT, agent));
    }
    Ok(api_client::builder(config)?
        .with_layer(&CountRequests(metrics.api_requests.clone()))
        .build())
}

/// Serves `/metrics`, `/healthz` and `/readyz` on `addr`.
async fn serve_metrics(addr: SocketAddr, metrics: Arc<Metrics>) -> Result<(), Fatal> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(Fatal::Metrics)?;
    tokio::spawn(async move {
        if let Err(e) = gpuhealth_http::serve(listener, metrics).await {
            error!(error = %e, "the metrics endpoint stopped");
        }
    });
    Ok(())
}

fn lease_settings(args: &Args) -> Settings {
    Settings {
        namespace: args.namespace.clone(),
        name: args.lease_name.clone(),
        identity: args.pod_name.clone(),
        lease_duration: args.lease_duration,
        renew_deadline: args.renew_deadline,
        retry_period: args.retry_period,
    }
}

/// Waits for every store a step reads (`Context::caches_ready`), saying
/// every half minute that it still does; false if stopped meanwhile.
async fn caches_ready(ctx: &Context) -> Result<bool, Fatal> {
    let waiting = std::time::Instant::now();
    let ready = ctx.caches_ready();
    tokio::pin!(ready);
    loop {
        tokio::select! {
            listed = &mut ready => {
                listed.map_err(|e| kube::Error::Service(Box::new(e)))?;
                info!(took = ?waiting.elapsed(), "disruption budgets, devices and other tools' locks read: deciding");
                return Ok(true);
            }
            () = tokio::time::sleep(CACHES_LATE) => warn!(
                waited = ?waiting.elapsed(),
                "no decision yet: the disruption budgets, devices or other tools' locks are not read yet (may this replica list them?)"
            ),
            () = shutdown_signal() => return Ok(false),
        }
    }
}

/// SIGTERM (how Kubernetes stops a pod) or Ctrl-C.
async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => futures::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = term => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn flags_are_consistent() {
        super::Args::command().debug_assert();
    }

    #[test]
    fn condition_types_are_read_as_the_configmap_writes_them() {
        use clap::Parser;
        use gpuhealth_engine::guardrails::ConditionTypes;
        let types = |value: &str| {
            let args =
                super::Args::try_parse_from(["gpuhealth-operator", "--condition-types", value])
                    .expect("flags");
            super::guardrails(&args).map(|g| g.condition_types)
        };
        assert_eq!(types(""), Ok(ConditionTypes::Only(Vec::new())));
        assert_eq!(
            types("SysLogsXIDError,example.com/Gpu"),
            Ok(ConditionTypes::Only(vec![
                "SysLogsXIDError".into(),
                "example.com/Gpu".into()
            ]))
        );
        assert_eq!(types("*"), Ok(ConditionTypes::Any));
        // Would end the admission policy's CEL string early.
        assert!(types("A','B").is_err());
        assert!(types("A, B").is_err());
    }
}
