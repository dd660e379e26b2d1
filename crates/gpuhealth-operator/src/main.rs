//! gpuhealth-operator: watches the nodes that `GpuHealthPolicy` objects
//! select and takes each unhealthy one from first signal back to serving.

mod actions;
mod conditions;
mod context;
mod observe;
mod reconcile;
mod selection;

use std::{process::ExitCode, sync::Arc};

use clap::{Parser, ValueEnum};
use futures::StreamExt;
use gpuhealth_api::{GpuHealthPolicy, GpuNodeHealth};
use k8s_openapi::api::core::v1::Node;
use kube::{
    Api, Client, Config,
    runtime::{
        Controller, WatchStreamExt,
        events::{Recorder, Reporter},
        reflector::{self, ObjectRef},
        watcher,
    },
};
use tracing::{error, info};

use crate::context::Context;

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
    /// This replica's name, for Events (from the downward API).
    #[arg(long, env = "POD_NAME", default_value = "gpuhealth-operator")]
    pod_name: String,
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

async fn run(args: Args) -> Result<(), kube::Error> {
    let mut config = Config::infer().await.map_err(kube::Error::InferConfig)?;
    // A 429 from the Eviction API means a PodDisruptionBudget says "not now":
    // the reconcile requeues; it must not block in the client's retry loop.
    config.default_retry = false;
    let client = Client::try_from(config)?;
    info!(
        version = env!("CARGO_PKG_VERSION"),
        "gpuhealth-operator starting"
    );

    // Stores the reconciles read from. The controller's own watches below
    // only trigger reconciles; kube's stable API cannot share one stream.
    let (policies, policy_writer) = reflector::store::<GpuHealthPolicy>();
    let (node_health, health_writer) = reflector::store::<GpuNodeHealth>();
    let policy_api = Api::<GpuHealthPolicy>::all(client.clone());
    let health_api = Api::<GpuNodeHealth>::all(client.clone());
    tokio::spawn(
        reflector::reflector(
            policy_writer,
            watcher(policy_api.clone(), watcher::Config::default()),
        )
        .default_backoff()
        .for_each(|_| futures::future::ready(())),
    );
    tokio::spawn(
        reflector::reflector(
            health_writer,
            watcher(health_api.clone(), watcher::Config::default()),
        )
        .default_backoff()
        .for_each(|_| futures::future::ready(())),
    );
    policies
        .wait_until_ready()
        .await
        .map_err(|e| kube::Error::Service(Box::new(e)))?;
    node_health
        .wait_until_ready()
        .await
        .map_err(|e| kube::Error::Service(Box::new(e)))?;

    let controller = Controller::new(Api::<Node>::all(client.clone()), watcher::Config::default());
    let nodes = controller.store();
    let ctx = Arc::new(Context {
        client: client.clone(),
        nodes: nodes.clone(),
        policies,
        node_health,
        decisions: Default::default(),
        recorder: Recorder::new(
            client,
            Reporter {
                controller: "gpuhealth-operator".into(),
                instance: Some(args.pod_name),
            },
        ),
    });
    // A policy change may change any node's decision; a node-health change
    // only its own node's.
    let all_nodes = nodes.clone();
    controller
        .watches(policy_api, watcher::Config::default(), move |_| {
            all_nodes
                .state()
                .iter()
                .map(|n| ObjectRef::from_obj(n.as_ref()))
                .collect::<Vec<_>>()
        })
        .watches(
            health_api,
            watcher::Config::default(),
            |g: GpuNodeHealth| std::iter::once(ObjectRef::new(&kube::ResourceExt::name_any(&g))),
        )
        .shutdown_on_signal()
        .run(reconcile::reconcile, reconcile::error_policy, ctx)
        .for_each(|_| futures::future::ready(()))
        .await;
    info!("gpuhealth-operator stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn flags_are_consistent() {
        super::Args::command().debug_assert();
    }
}
