//! From the Xid to the cordon: the time a user feels, detection included.
//! Real agent binaries (NVML backend, the flags `config/agent/container-toolkit`
//! ships) serve nodes of their own, each on a simulated host
//! (`gpuhealth_e2e::host`: the NVML stand-in library and a kernel log). The
//! bench writes an Xid where the driver would, into the kernel log or as an
//! NVML event, never both, and the fleet's watch sees the agent's report
//! name the Xid and then the cordon. While NVML's events are up the agent
//! believes a kernel-log-only Xid only once NVML corroborates it (a
//! tenant's process can print into the log), so the kernel log's path
//! sets the GPU's recovery action to a reset first, as the driver does for
//! this Xid: that path's figure includes the corroboration. Each node recovers (the agent resets the
//! GPU through the stand-in's nvidia-smi) before its next fault.
//!
//! Two stand-ins poll where a real node would block: the kernel log is a
//! plain file read every 200 ms (`/dev/kmsg` wakes its reader at once) and
//! the stand-in's `nvmlEventSetWait` looks for events every 20 ms. Both
//! add to the figure, at most that much each. On a real node the shipped
//! agent is not privileged, may not open `/dev/kmsg`, and reads the ring
//! buffer through `syslog(2)` once a second: there a kernel-log-only Xid
//! can wait up to a second longer than here. The driver's NVML event for
//! the same Xid does not wait for that.

use std::time::{Duration, Instant};

use futures::future::try_join_all;
use gpuhealth_api::{
    GpuNodeHealth,
    contract::GpuReport,
    node_health::{GpuNodeHealthStatus, Phase},
    vocabulary::IncidentOutcome,
};
use gpuhealth_e2e::{
    host::{Agent, Host},
    sim::{GpuNodeSpec, gpu_node, is_cordoned},
    wait,
};
use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client, api::PostParams};
use serde_json::json;

use crate::{
    Args, Result,
    policy::create_policy,
    results::{Detection, PathFigures},
    say,
    watch::{Cordons, awaited, names_an_xid, report},
};

const GROUP: &str = "bench-detect";
/// The incident's first Xid: a reset is what it needs.
const XID: u32 = 119;
const XID_TEXT: &str = "Timeout after 45s of waiting for RPC response from GPU GSP";
/// The longest one fault may take to be cordoned, or its node to recover.
const STEP: Duration = Duration::from_secs(120);

/// Where the driver's word of an Xid reaches the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    KernelLog,
    Nvml,
}

impl Path {
    fn write(self, host: &Host, gpu: usize) -> Result<()> {
        match self {
            Path::KernelLog => {
                host.set(gpu, "recovery_action", "1")?;
                host.kernel_log_xid(gpu, XID, XID_TEXT, Duration::ZERO)?
            }
            Path::Nvml => host.nvml_xid(gpu, XID)?,
        }
        Ok(())
    }
}

/// One fault: its path, and seconds from the Xid's write to the report
/// naming it seen and to the cordon seen (none if not cordoned within [`STEP`]).
struct Sample {
    path: Path,
    reported: Option<f64>,
    cordoned: Option<f64>,
}

fn node_name(i: usize) -> String {
    format!("detect-{i:02}")
}

/// `--detect-faults` faults on each path, spread over `--detect-nodes`
/// nodes that take them in turn, alternating paths.
pub async fn measure(args: &Args, client: &Client, cordons: &Cordons) -> Result<Detection> {
    say(&format!(
        "from the Xid to the cordon: {} real agents, {} faults on each path",
        args.detect_nodes, args.detect_faults
    ));
    create_policy(
        client,
        GROUP,
        // Every GPU fails again and again: no limit, or a repeat would hand
        // the node over instead of resetting the GPU.
        json!({"maxConcurrent": "100%", "remediationLimits": {"perGpu": 0, "perNode": 0}}),
    )
    .await?;
    let mut served = Vec::new();
    for i in 0..args.detect_nodes {
        served.push(serve(client, &node_name(i)).await?);
    }
    let faults = 2 * args.detect_faults;
    let per_node = faults.div_ceil(served.len());
    let runs = served.iter().enumerate().map(|(i, (host, _agent))| {
        let count = per_node.min(faults.saturating_sub(i * per_node));
        // Each node starts on its own path, so both are spread over all.
        faults_on(client, cordons, host, count, i)
    });
    let samples: Vec<Sample> = try_join_all(runs).await?.into_iter().flatten().collect();
    let of = |path: Path| {
        let taken: Vec<&Sample> = samples.iter().filter(|s| s.path == path).collect();
        PathFigures::of(
            taken.iter().filter_map(|s| s.reported).collect(),
            taken.iter().filter_map(|s| s.cordoned).collect(),
            taken.iter().filter(|s| s.cordoned.is_none()).count(),
        )
    };
    Ok(Detection {
        agents: served.len(),
        kernel_log: of(Path::KernelLog),
        nvml: of(Path::Nvml),
    })
}

/// A Ready node of the group, its host, and the shipped agent serving it,
/// once its report from NVML offers a reset (the executor checks it can
/// before the reporter offers it: a fault before that would pass over the
/// rung) and the operator took the node in.
async fn serve(client: &Client, node: &str) -> Result<(Host, Agent)> {
    let nodes: Api<Node> = Api::all(client.clone());
    nodes
        .create(
            &PostParams::default(),
            &gpu_node(node, GROUP, &GpuNodeSpec::default()),
        )
        .await?;
    let mut host = Host::new(node, 8)?;
    host.kubelet(client)?;
    let agent = host
        .start_agent(&format!("bench-{node}-agent"), &[])
        .await?;
    wait::until(nodes, node, STEP, |n| {
        report(n).is_some_and(|r| {
            r.source.as_deref() == Some("gpuhealth-agent/nvml")
                && r.capabilities.is_some_and(|c| c.reset)
                && clear(&r)
        })
    })
    .await?;
    serving(client, node, |s| s.phase == Phase::Healthy).await?;
    Ok((host, agent))
}

/// Every GPU healthy and no Xid named: the next Xid is seen arriving.
fn clear(report: &GpuReport) -> bool {
    report.bad_gpus().next().is_none() && !names_an_xid(report)
}

/// `count` faults on `host`'s node, one after another, each on the next
/// GPU, paths alternating from the `first`'s.
async fn faults_on(
    client: &Client,
    cordons: &Cordons,
    host: &Host,
    count: usize,
    first: usize,
) -> Result<Vec<Sample>> {
    let mut samples = Vec::new();
    for k in 0..count {
        let path = if (first + k).is_multiple_of(2) {
            Path::KernelLog
        } else {
            Path::Nvml
        };
        let before = newest_incident(client, &host.node).await?;
        let written = Instant::now();
        path.write(host, k % host.gpus)?;
        let seen = awaited(written + STEP, || {
            cordons.xid_to_cordon(&host.node, written)
        })
        .await;
        let since = |t: Instant| t.duration_since(written).as_secs_f64();
        samples.push(Sample {
            path,
            reported: seen.map(|(sick, _)| since(sick)),
            cordoned: seen.map(|(_, cordoned)| since(cordoned)),
        });
        // Back in service after an incident other than the one before.
        serving(client, &host.node, |s| {
            s.phase == Phase::Healthy
                && s.history.first().is_some_and(|i| {
                    Some(&i.id) != before.as_ref() && i.outcome == Some(IncidentOutcome::Recovered)
                })
        })
        .await?;
    }
    Ok(samples)
}

/// The id of `node`'s newest incident, if it had one.
async fn newest_incident(client: &Client, node: &str) -> Result<Option<String>> {
    let health = Api::<GpuNodeHealth>::all(client.clone()).get(node).await?;
    Ok(health
        .status
        .and_then(|s| s.history.into_iter().next())
        .map(|i| i.id))
}

/// Waits until `node`'s status is `settled`, then until it serves: its
/// cordon gone and the agent's report all healthy, naming no Xid.
async fn serving(
    client: &Client,
    node: &str,
    settled: impl Fn(&GpuNodeHealthStatus) -> bool,
) -> Result<()> {
    let healths = Api::<GpuNodeHealth>::all(client.clone());
    let settling = wait::until(healths.clone(), node, STEP, |h| {
        h.status.as_ref().is_some_and(&settled)
    })
    .await;
    if let Err(e) = settling {
        let status = healths.get(node).await?.status.unwrap_or_default();
        let newest = status.history.first();
        return Err(format!(
            "{node} did not settle ({e}): phase {:?}, newest incident {:?} ({:?})",
            status.phase,
            newest.map(|i| &i.id),
            newest.map(|i| &i.outcome),
        )
        .into());
    }
    wait::until(Api::<Node>::all(client.clone()), node, STEP, |n| {
        !is_cordoned(n) && report(n).is_some_and(|r| clear(&r))
    })
    .await?;
    Ok(())
}
