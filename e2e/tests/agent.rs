//! The real `gpuhealth-agent` binary (fake backend) on a simulated node,
//! against the real API server: it publishes what the hardware says, only
//! when it changes, and carries out each request at most once, across
//! restarts too.
//!
//! Long because each test is one scenario against a real API server, and
//! they share the agent's setup.

use std::{
    collections::BTreeSet,
    path::PathBuf,
    sync::{Arc, Mutex},
    time::Instant,
};

use futures::StreamExt;
use gpuhealth_agent::fake::{SimHardware, SimOutcome};
use gpuhealth_api::{
    GpuHealth, RecoveryAction,
    contract::{
        AnnotationValue, GPU_HEALTHY_CONDITION, GPU_REPORT_ANNOTATION, GpuReport, Outcome,
        REBOOT_REQUEST_ANNOTATION, REQUEST_RESULT_ANNOTATION, RESET_REQUEST_ANNOTATION,
        RebootRequest, RequestResult, ResetRequest,
    },
};
use gpuhealth_e2e::{
    client, in_flight,
    node_agent::{self, hardware, set_hardware},
    process::{Process, capability_mask},
    reports,
    scenario::WAIT,
    shipped::{Part, shipped_capabilities},
    sim::{ready_gpu_node, remove_node, set_cordon},
    wait::{Background, applied, event_saying, until, within},
};
use k8s_openapi::{
    api::core::v1::Node,
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::{SignedDuration, Timestamp},
};
use kube::{
    Api, Client, ResourceExt,
    api::{Patch, PatchParams},
    runtime::watcher,
};
use serde_json::json;

/// A Ready simulated node with eight healthy GPUs, and a fresh state dir.
async fn node(name: &str) -> (Client, String, PathBuf) {
    let client = client().await.expect("client");
    let node = ready_gpu_node(&client, name).await.expect("a Ready node");
    set_hardware(&client, &node, &healthy())
        .await
        .expect("hardware");
    let state = std::env::temp_dir().join(format!("gpuhealth-agent-{node}"));
    let _ = std::fs::remove_dir_all(&state);
    (client, node, state)
}

/// A node whose GPU 7 needs a reset (a reboot would end in `reboot`),
/// served by the real agent: the client, the node, GPU 7's UUID, the agent.
async fn served_with_gpu7_needing_reset(
    name: &str,
    reboot: SimOutcome,
) -> (Client, String, String, Process) {
    served_as(name, reboot, &["--backend", "fake"]).await
}

/// As [`served_with_gpu7_needing_reset`], the agent started with `args`.
async fn served_as(
    name: &str,
    reboot: SimOutcome,
    args: &[&str],
) -> (Client, String, String, Process) {
    let (client, node, state) = node(name).await;
    let mut hw = healthy();
    hw.gpus[7].health = GpuHealth::ResetRequired;
    hw.gpus[7].recovery_action = Some(1);
    hw.reboot = reboot;
    set_hardware(&client, &node, &hw)
        .await
        .expect("GPU 7 needs a reset");
    let gpu7 = hw.gpus[7].uuid.clone();
    let agent = node_agent::start_with(&format!("{node}-agent"), &node, &state, None, args)
        .await
        .expect("agent");
    (client, node, gpu7, agent)
}

fn healthy() -> SimHardware {
    SimHardware {
        gpus: reports::healthy("serving", &[]).gpus,
        reset: SimOutcome::Succeed,
        reboot: SimOutcome::Succeed,
        reset_takes: None,
        executed: Vec::new(),
        capabilities: None,
    }
}

fn report(n: &Node) -> Option<GpuReport> {
    GpuReport::parse(n.annotations().get(GPU_REPORT_ANNOTATION)?).ok()
}

fn result(n: &Node) -> Option<RequestResult> {
    RequestResult::parse(n.annotations().get(REQUEST_RESULT_ANNOTATION)?).ok()
}

fn gpu_healthy_condition(n: &Node) -> Option<String> {
    n.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == GPU_HEALTHY_CONDITION)
        .map(|c| c.status.clone())
}

async fn request_reset(client: &Client, node: &str, id: &str, gpu: &str, at: Timestamp) {
    in_flight::request_reset(client, node, id, gpu, at)
        .await
        .expect("a reset request");
}

async fn answered(client: &Client, node: &str, id: &str) -> (Node, RequestResult) {
    let n = until(Api::<Node>::all(client.clone()), node, WAIT, |n| {
        result(n).is_some_and(|r| r.id.to_string() == id)
    })
    .await
    .unwrap_or_else(|e| panic!("an answer to {id}: {e}"));
    let r = result(&n).expect("result");
    (n, r)
}

#[tokio::test]
async fn the_report_follows_the_hardware_and_is_written_only_on_change() {
    let (client, node, state) = node("agent-report").await;
    let agent = node_agent::start(&format!("{node}-agent"), &node, &state, None)
        .await
        .expect("agent");
    let nodes: Api<Node> = Api::all(client.clone());
    until(nodes.clone(), &node, WAIT, |n| {
        report(n).is_some_and(|r| {
            r.gpus.len() == 8 && r.source.as_deref() == Some("gpuhealth-agent/fake")
        }) && gpu_healthy_condition(n).as_deref() == Some("True")
    })
    .await
    .expect("the first report and GpuHealthy=True");

    // Every distinct report value the Node ever carries from now on.
    let values: Arc<Mutex<BTreeSet<String>>> = Arc::default();
    let recorder = {
        let values = values.clone();
        let config = watcher::Config::default().fields(&format!("metadata.name={node}"));
        Background::spawn({
            let nodes = nodes.clone();
            async move {
                let mut stream = std::pin::pin!(applied(nodes, config));
                while let Some(n) = stream.next().await {
                    if let (Some(v), Ok(mut set)) =
                        (n.annotations().get(GPU_REPORT_ANNOTATION), values.lock())
                    {
                        set.insert(v.clone());
                    }
                }
            }
        })
    };
    // Changes to the Node that are not the hardware: each wakes the agent,
    // and none may make it write.
    for i in 0..5 {
        let patch = json!({"metadata": {"annotations": {"e2e.gpuhealth.io/touch": i.to_string()}}});
        nodes
            .patch(&node, &PatchParams::default(), &Patch::Merge(patch))
            .await
            .expect("touch");
    }
    let mut broken = healthy();
    broken.gpus[6].health = GpuHealth::ResetRequired;
    broken.gpus[6].recovery_action = Some(1);
    let changed = Instant::now();
    set_hardware(&client, &node, &broken)
        .await
        .expect("GPU 6 breaks");
    let n = until(nodes.clone(), &node, WAIT, |n| {
        report(n).is_some_and(|r| r.gpus[6].health == GpuHealth::ResetRequired)
    })
    .await
    .expect("the report shows it");
    let latency = changed.elapsed();
    eprintln!("hardware change to report on the Node: {latency:?}");
    until(nodes, &node, WAIT, |n| {
        gpu_healthy_condition(n).as_deref() == Some("False")
    })
    .await
    .expect("GpuHealthy=False");
    drop(recorder);
    let seen = values.lock().map(|v| v.len()).unwrap_or_default();
    assert_eq!(
        seen, 2,
        "one write for the change and none for the five other Node updates"
    );
    assert_eq!(report(&n).map(|r| r.bad_gpus().count()), Some(1));
    let metrics = agent.scrape().await.expect("metrics");
    for line in [
        "gpuhealth_agent_report_writes_total 2",
        "gpuhealth_agent_gpus{health=\"ResetRequired\"} 1",
        "gpuhealth_agent_gpus{health=\"Healthy\"} 7",
    ] {
        assert!(metrics.contains(line), "{line} in:\n{metrics}");
    }
    remove_node(&client, &node).await;
}

#[tokio::test]
async fn with_nothing_new_the_report_and_condition_are_refreshed_at_the_refresh_rate() {
    let (client, node, state) = node("agent-refresh").await;
    let agent = node_agent::start_with(
        &format!("{node}-agent"),
        &node,
        &state,
        None,
        &["--backend", "fake", "--refresh", "3s"],
    )
    .await
    .expect("agent");
    let nodes: Api<Node> = Api::all(client.clone());
    let first = until(nodes.clone(), &node, WAIT, |n| report(n).is_some())
        .await
        .expect("the first report");
    let first = report(&first).expect("report").observed_at;
    // Nothing changes; the report's time moves on, twice.
    let seen: Arc<Mutex<BTreeSet<String>>> = Arc::default();
    let moved = until(nodes, &node, WAIT, |n| {
        let Some(r) = report(n) else { return false };
        let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
        seen.insert(r.observed_at.0.to_string());
        seen.len() >= 3
    })
    .await
    .expect("refreshed twice");
    let last = report(&moved).expect("report");
    assert!(last.observed_at.0 > first.0);
    assert_eq!(last.bad_gpus().count(), 0);
    // Each refresh is two writes, the report and the condition, and only
    // those. The agent counts a write when its answer arrives, which may be
    // after the watch above saw it: look until the third is counted.
    let patches = |metrics: &str, resource: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| {
                l.strip_prefix(&format!(
                    "gpuhealth_agent_api_requests_total{{verb=\"patch\",resource=\"{resource}\",code=\"200\"}} "
                ))
            })
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    let metrics = within("the agent counting its third report write", WAIT, async {
        loop {
            let metrics = agent.scrape().await?;
            if patches(&metrics, "nodes") >= 3 {
                return Ok(metrics);
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        }
    })
    .await
    .expect("three report writes counted");
    let (reports, conditions) = (
        patches(&metrics, "nodes"),
        patches(&metrics, "nodes/status"),
    );
    assert!(reports >= 3, "{metrics}");
    assert!(
        conditions.abs_diff(reports) <= 1,
        "one condition write per report write: {reports} and {conditions}"
    );
    remove_node(&client, &node).await;
}

#[tokio::test]
async fn a_request_is_carried_out_once_and_repeated_or_stale_ones_are_not() {
    let (client, node, gpu7, _agent) =
        served_with_gpu7_needing_reset("agent-requests", SimOutcome::Succeed).await;

    request_reset(&client, &node, "inc-1-reset-1", &gpu7, Timestamp::now()).await;
    let (n, r) = answered(&client, &node, "inc-1-reset-1").await;
    assert_eq!(r.outcome, Outcome::Succeeded, "{r:?}");
    assert_eq!(
        hardware(&n).map(|h| h.executed),
        Some(vec!["inc-1-reset-1".to_owned()])
    );
    until(Api::<Node>::all(client.clone()), &node, WAIT, |n| {
        report(n).is_some_and(|r| r.bad_gpus().next().is_none())
    })
    .await
    .expect("GPU 7 healthy again in the report");

    // The same id again (a re-issued annotation), then a stale request: the
    // stale one is answered, neither is carried out.
    request_reset(&client, &node, "inc-1-reset-1", &gpu7, Timestamp::now()).await;
    let two_hours_ago = Timestamp::now() - SignedDuration::from_hours(2);
    request_reset(&client, &node, "inc-2-reset-1", &gpu7, two_hours_ago).await;
    let (n, r) = answered(&client, &node, "inc-2-reset-1").await;
    assert_eq!(r.outcome, Outcome::Refused, "{r:?}");
    assert!(r.message.contains("request-max-age"), "{}", r.message);
    assert_eq!(
        hardware(&n).map(|h| h.executed),
        Some(vec!["inc-1-reset-1".to_owned()]),
        "nothing carried out twice, nothing stale carried out"
    );
    remove_node(&client, &node).await;
}

/// Every agent these tests start runs as the shipped containers would:
/// one that runs both parts (a simulated node's) with exactly the
/// capabilities `config/agent/container-toolkit` adds to either part, and
/// no way to gain more. (Each part alone, with its own:
/// `e2e/tests/nvml_node.rs`.)
#[tokio::test]
async fn the_agent_runs_with_only_the_capabilities_its_manifest_adds() {
    let (client, node, state) = node("agent-caps").await;
    let agent = node_agent::start(&format!("{node}-agent"), &node, &state, None)
        .await
        .expect("agent");
    // Past setpriv's exec: serving the node.
    until(Api::<Node>::all(client.clone()), &node, WAIT, |n| {
        report(n).is_some()
    })
    .await
    .expect("a report");
    let mut shipped = Vec::new();
    for part in Part::BOTH {
        shipped.extend(
            shipped_capabilities("container-toolkit", part)
                .await
                .expect("the shipped capabilities"),
        );
    }
    let expected = capability_mask(&shipped).expect("known capabilities");
    let held = agent.capabilities().expect("its capabilities");
    for (set, have) in [
        ("effective", held.effective),
        ("permitted", held.permitted),
        ("bounding", held.bounding),
    ] {
        assert_eq!(
            have, expected,
            "{set} {have:x}, shipped {shipped:?} = {expected:x}"
        );
    }
    assert!(held.no_new_privileges);
    drop(agent);
    remove_node(&client, &node).await;
}

/// A request written to the Node by anyone but the operator (here the
/// cluster's admin, whom admission lets through) is not carried out: the
/// executor, run alone as its DaemonSet runs it (its own capabilities, no
/// reporter beside it), refuses what the node's `GpuNodeHealth` does not
/// record in flight on a node cordoned for it, and says why on the Node's
/// Events.
#[tokio::test]
async fn a_request_the_operator_did_not_record_is_refused_on_the_nodes_events() {
    let (client, node, gpu7, _executor) = served_as(
        "agent-refuses",
        SimOutcome::Succeed,
        &["--backend", "fake", "--role", "executor"],
    )
    .await;
    gpuhealth_e2e::crds::install(&client).await.expect("CRDs");
    let nodes: Api<Node> = Api::all(client.clone());
    let write = |id: &'static str| {
        let request = ResetRequest {
            id: id.parse().expect("id"),
            gpus: vec![gpu7.clone()],
            requested_at: Time(Timestamp::now()),
        };
        json!({"metadata": {"annotations": {RESET_REQUEST_ANNOTATION: request.to_annotation()}}})
    };
    let params = PatchParams::default();

    // No record at all.
    nodes
        .patch(&node, &params, &Patch::Merge(write("inc-8-reset-1")))
        .await
        .expect("a request by hand");
    event_saying(
        &client,
        &node,
        "RequestRefused",
        "inc-8-reset-1 refused: the node's GpuNodeHealth records no request",
    )
    .await
    .expect("the refusal on the Node's Events");

    // Another request recorded in flight.
    in_flight::record(
        &client,
        &node,
        RecoveryAction::GpuReset,
        "inc-9-reset-1",
        std::slice::from_ref(&gpu7),
    )
    .await
    .expect("recorded");
    nodes
        .patch(&node, &params, &Patch::Merge(write("inc-9-reset-2")))
        .await
        .expect("a request by hand");
    event_saying(
        &client,
        &node,
        "RequestRefused",
        "records inc-9-reset-1 in flight, not this one",
    )
    .await
    .expect("the refusal on the Node's Events");

    // The recorded one, on a node uncordoned since.
    set_cordon(&client, &node, false).await.expect("uncordon");
    nodes
        .patch(&node, &params, &Patch::Merge(write("inc-9-reset-1")))
        .await
        .expect("the recorded request");
    event_saying(
        &client,
        &node,
        "RequestRefused",
        "inc-9-reset-1 refused: the node is not cordoned",
    )
    .await
    .expect("the refusal on the Node's Events");

    let n = nodes.get(&node).await.expect("node");
    assert_eq!(
        hardware(&n).map(|h| h.executed),
        Some(vec![]),
        "nothing carried out"
    );
    assert!(result(&n).is_none(), "nothing answered: {:?}", result(&n));

    // Cordoned again, the recorded request holds: a refusal is looked at
    // again, so that no early write can block the operator's request.
    set_cordon(&client, &node, true).await.expect("cordon");
    let (n, r) = answered(&client, &node, "inc-9-reset-1").await;
    assert_eq!(r.outcome, Outcome::Succeeded, "{r:?}");
    assert_eq!(
        hardware(&n).map(|h| h.executed),
        Some(vec!["inc-9-reset-1".to_owned()])
    );
    remove_node(&client, &node).await;
}

/// Found by the chaos runs: a new incident's reset request made within the
/// second of the last incident's answered reboot was taken for an older
/// request the reboot had superseded, and never carried out.
#[tokio::test]
async fn a_request_in_the_same_second_as_the_last_answered_one_is_carried_out() {
    let (client, node, gpu7, _agent) =
        served_with_gpu7_needing_reset("agent-same-second", SimOutcome::Fail).await;
    let second = Timestamp::from_second(Timestamp::now().as_second()).expect("now");
    in_flight::record(
        &client,
        &node,
        RecoveryAction::NodeReboot,
        "inc-1-reboot-1",
        &[],
    )
    .await
    .expect("recorded in flight");
    let reboot = RebootRequest {
        id: "inc-1-reboot-1".parse().expect("id"),
        requested_at: Time(second),
    };
    let patch =
        json!({"metadata": {"annotations": {REBOOT_REQUEST_ANNOTATION: reboot.to_annotation()}}});
    Api::<Node>::all(client.clone())
        .patch(&node, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .expect("reboot request");
    let (_, r) = answered(&client, &node, "inc-1-reboot-1").await;
    assert_eq!(r.outcome, Outcome::Failed, "{r:?}");
    request_reset(&client, &node, "inc-2-reset-1", &gpu7, second).await;
    let (n, r) = answered(&client, &node, "inc-2-reset-1").await;
    assert_eq!(r.outcome, Outcome::Succeeded, "{r:?}");
    assert_eq!(
        hardware(&n).map(|h| h.executed),
        Some(vec![
            "inc-1-reboot-1".to_owned(),
            "inc-2-reset-1".to_owned()
        ]),
        "each carried out once"
    );
    remove_node(&client, &node).await;
}

#[tokio::test]
async fn an_agent_restarted_mid_request_never_carries_it_out_twice() {
    let (client, node, state) = node("agent-restart").await;
    let gpu7 = healthy().gpus[7].uuid.clone();

    // Dies after carrying it out, before writing the result.
    let mut first = node_agent::start(&format!("{node}-finished"), &node, &state, Some("finished"))
        .await
        .expect("agent");
    request_reset(&client, &node, "inc-3-reset-1", &gpu7, Timestamp::now()).await;
    let exit = first.exited(WAIT).await.expect("the crash");
    assert_eq!(exit.code(), Some(3));
    let nodes: Api<Node> = Api::all(client.clone());
    let n = nodes.get(&node).await.expect("node");
    assert!(result(&n).is_none(), "no result written before the crash");
    let _second = node_agent::start(&format!("{node}-after-finished"), &node, &state, None)
        .await
        .expect("agent");
    let (n, r) = answered(&client, &node, "inc-3-reset-1").await;
    assert_eq!(r.outcome, Outcome::Succeeded, "the journalled result");
    assert_eq!(
        hardware(&n).map(|h| h.executed),
        Some(vec!["inc-3-reset-1".to_owned()])
    );
    drop(_second);

    // Dies after journalling the start, before carrying it out.
    let mut third = node_agent::start(&format!("{node}-begun"), &node, &state, Some("begun"))
        .await
        .expect("agent");
    request_reset(&client, &node, "inc-4-reset-1", &gpu7, Timestamp::now()).await;
    assert_eq!(third.exited(WAIT).await.expect("the crash").code(), Some(3));
    let _fourth = node_agent::start(&format!("{node}-after-begun"), &node, &state, None)
        .await
        .expect("agent");
    let (n, r) = answered(&client, &node, "inc-4-reset-1").await;
    assert_eq!(r.outcome, Outcome::Failed, "{r:?}");
    assert!(r.message.contains("not repeated"), "{}", r.message);
    assert_eq!(
        hardware(&n).map(|h| h.executed),
        Some(vec!["inc-3-reset-1".to_owned()]),
        "the interrupted request was not carried out afterwards"
    );
    remove_node(&client, &node).await;
}

/// Where the kernel log is not there (as `/dev/kmsg` is not in a container
/// that is not privileged), the agent reads the kernel's ring
/// buffer through syslog(2) with the CAP_SYSLOG its manifest gives it,
/// records and facilities as the kernel keeps them: the driver's words in
/// a record a process wrote are read, counted and not taken as the driver's.
#[tokio::test]
async fn a_kernel_log_it_may_not_open_is_read_through_syslog() {
    let (client, node, state) = node("agent-syslog").await;
    // A bus of this run's own: the ring buffer keeps earlier runs' records.
    let bus = 0x30 + std::process::id() % 0xc0;
    // Not there, as in the shipped container (its runtime makes no
    // /dev/kmsg, and the manifest mounts none).
    let kmsg = state.with_extension("no-kmsg");
    let _ = std::fs::remove_file(&kmsg);
    let kmsg_arg = kmsg.display().to_string();
    let args = ["--backend", "kmsg", "--kmsg-path", kmsg_arg.as_str()];
    let mut agent = node_agent::start_with(&format!("{node}-agent"), &node, &state, None, &args)
        .await
        .expect("agent");
    if gpuhealth_klog::read_all(&mut Vec::new()).is_ok() {
        // What a process with /dev/kmsg may write: the driver's words under
        // the driver's priority. The kernel stamps a process's records with
        // a facility of their own (LOG_USER), which the agent reads through
        // syslog(2) and does not take as the driver's: it counts each, and
        // names no GPU from them.
        for record in [
            format!(
                "<6>NVRM: GPU at PCI:0000:{bus:02x}:00: GPU-5e1f0000-0000-4000-8000-0000000000{bus:02x}\n"
            ),
            format!(
                "<4>NVRM: Xid (PCI:0000:{bus:02x}:00): 79, pid=1, name=gpuhealth-e2e, GPU has fallen off the bus.\n"
            ),
        ] {
            std::fs::write("/dev/kmsg", record).expect("writing a record to the kernel log");
        }
        let deadline = std::time::Instant::now() + WAIT;
        let ours = format!("PCI:0000:{bus:02x}:00");
        loop {
            let read = agent
                .log_text()
                .lines()
                .filter(|l| l.contains("not its own") && l.contains(&ours))
                .count();
            let metrics = agent.scrape().await.expect("metrics");
            let counted = metrics
                .lines()
                .find(|l| l.starts_with("gpuhealth_agent_kernel_lines_not_the_drivers_total "))
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
            if read == 2 && counted.is_some_and(|n| n >= 2.0) {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the records, read from the ring buffer and refused: {read} said, {counted:?} counted"
            );
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        }
        let n = Api::<Node>::all(client.clone())
            .get(&node)
            .await
            .expect("node");
        let pci = format!("00000000:{bus:02X}:00.0");
        assert!(
            report(&n).is_some_and(|r| r.source.as_deref() == Some("gpuhealth-agent/kmsg")
                && r.gpus.iter().all(|g| g.pci_bus_id != pci)),
            "a GPU named from a process's record: {:?}",
            report(&n)
        );
        let log = agent.log_text();
        assert!(
            log.contains("following the kernel log through=\"syslog(2)\""),
            "{log}"
        );
    } else {
        // This machine forbids syslog(2) even to root: the agent says both.
        agent.exited(WAIT).await.expect("it stops");
        let log = agent.log_text();
        assert!(log.contains("syslog(2): Operation not permitted"), "{log}");
    }
    remove_node(&client, &node).await;
}

#[tokio::test]
async fn the_kernel_log_backend_reports_what_the_driver_logged() {
    // The kernel log alone (a file standing in for /dev/kmsg), chosen by hand.
    let (client, node, state) = node("agent-kmsg").await;
    let kmsg = state.with_extension("kmsg");
    let lines = [
        "6,100,1000000,-;NVRM: GPU at PCI:0000:e1:00: GPU-0a1b2c3d-0000-4000-8000-000000000007",
        "6,101,1000100,-;NVRM: GPU at PCI:0000:01:00: GPU-0a1b2c3d-0000-4000-8000-000000000000",
    ];
    std::fs::write(&kmsg, lines.join("\n") + "\n").expect("kernel log");
    let kmsg_arg = kmsg.display().to_string();
    let args = ["--backend", "kmsg", "--kmsg-path", kmsg_arg.as_str()];
    let agent = node_agent::start_with(&format!("{node}-agent"), &node, &state, None, &args)
        .await
        .expect("agent");
    let nodes: Api<Node> = Api::all(client.clone());
    until(nodes.clone(), &node, WAIT, |n| {
        report(n).is_some_and(|r| {
            r.source.as_deref() == Some("gpuhealth-agent/kmsg")
                && r.capabilities.is_some_and(|c| !c.reset)
                && r.gpus.len() == 2
                && r.bad_gpus().next().is_none()
        })
    })
    .await
    .expect("a healthy report from the log");

    // The incident's lines, appended as the driver would log them.
    use std::io::Write;
    let mut log = std::fs::OpenOptions::new()
        .append(true)
        .open(&kmsg)
        .expect("open");
    writeln!(log, "4,102,2000000,-;NVRM: Xid (PCI:0000:e1:00): 119, Timeout after 45s of waiting for RPC response from GPU GSP").expect("append");
    writeln!(log, "4,103,2000100,-;NVRM: Xid (PCI:0000:e1:00): 154, GPU recovery action changed from None to GPU Reset Required").expect("append");
    let n = until(nodes, &node, WAIT, |n| {
        report(n)
            .is_some_and(|r| r.bad_gpus().count() == 1 && r.bad_gpus().all(|g| g.xids.len() == 2))
    })
    .await
    .expect("GPU 7 reported from the log");
    let r = report(&n).expect("report");
    let bad = r.bad_gpus().next().expect("the bad GPU");
    assert_eq!(bad.uuid, "GPU-0a1b2c3d-0000-4000-8000-000000000007");
    assert_eq!(bad.health, GpuHealth::ResetRequired);
    assert_eq!(bad.recovery_action, Some(1));
    assert_eq!(
        bad.xids.iter().map(|x| x.code).collect::<Vec<_>>(),
        [119, 154]
    );
    let metrics = agent.scrape().await.expect("metrics");
    for code in [119, 154] {
        let line = format!("gpuhealth_agent_xids_total{{code=\"{code}\"}} 1");
        assert!(metrics.contains(&line), "{line} in:\n{metrics}");
    }

    drop(agent);
    remove_node(&client, &node).await;
}

#[tokio::test]
async fn without_nvml_the_agent_says_so_and_acts_on_nothing() {
    // This machine has no NVIDIA driver: the nvml backend cannot load NVML.
    // It says so in its report, its condition and its readiness, never by
    // reading less (the kernel log names GPUs here too).
    let (client, node, state) = node("agent-no-nvml").await;
    let kmsg = state.with_extension("kmsg");
    std::fs::write(
        &kmsg,
        "6,100,1000000,-;NVRM: GPU at PCI:0000:e1:00: GPU-0a1b2c3d-0000-4000-8000-000000000007\n",
    )
    .expect("kernel log");
    let kmsg_arg = kmsg.display().to_string();
    let args = [
        "--backend",
        "nvml",
        "--kmsg-path",
        kmsg_arg.as_str(),
        "--nvml-library",
        "libnvidia-ml-absent.so.1",
    ];
    let agent = node_agent::start_with(&format!("{node}-agent"), &node, &state, None, &args)
        .await
        .expect("agent");
    let nodes: Api<Node> = Api::all(client.clone());
    let n = until(nodes, &node, WAIT, |n| {
        report(n).is_some_and(|r| r.source.as_deref() == Some("gpuhealth-agent/nvml"))
            && gpu_healthy_condition(n).as_deref() == Some("Unknown")
    })
    .await
    .expect("a report saying the GPUs cannot be read, and GpuHealthy=Unknown");
    let r = report(&n).expect("report");
    let why = r.unreadable.clone().unwrap_or_default();
    assert!(why.contains("libnvidia-ml-absent.so.1"), "{why}");
    assert!(r.gpus.is_empty(), "no GPU is made up: {r:?}");
    let (status, body) = agent.get("/readyz", |s| s == 503).await.expect("not ready");
    assert_eq!(status, 503);
    assert!(body.contains("cannot be read"), "{body}");
    let (status, _) = agent.get("/livez", |s| s == 200).await.expect("alive");
    assert_eq!(status, 200);
    remove_node(&client, &node).await;
}

/// Resident memory of process `pid`, in KiB.
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn a_kernel_log_flood_leaves_the_agent_bounded() {
    let (client, node, state) = node("agent-flood").await;
    let kmsg = state.with_extension("kmsg");
    std::fs::write(
        &kmsg,
        "6,1,1,-;NVRM: GPU at PCI:0000:01:00: GPU-0a1b2c3d-0000-4000-8000-000000000000\n",
    )
    .expect("kernel log");
    let kmsg_arg = kmsg.display().to_string();
    let args = ["--backend", "kmsg", "--kmsg-path", kmsg_arg.as_str()];
    let agent = node_agent::start_with(&format!("{node}-agent"), &node, &state, None, &args)
        .await
        .expect("agent");
    let nodes: Api<Node> = Api::all(client.clone());
    until(nodes.clone(), &node, WAIT, |n| {
        report(n).is_some_and(|r| r.gpus.len() == 1)
    })
    .await
    .expect("a report from the log");
    let pid = agent.pid().expect("running");
    let before = rss_kib(pid);
    let agent_started = Instant::now();

    // 100,000 lines a second for ten seconds, as fast as a driver in
    // trouble could log: Xids of every code on one GPU, GPUs named at ever
    // new PCI addresses, noise, and now and then a line with no end in
    // sight. The agent's memory is sampled meanwhile.
    let flood = {
        let kmsg = kmsg.clone();
        tokio::task::spawn_blocking(move || {
            use std::io::Write;
            let mut log = std::io::BufWriter::new(
                std::fs::OpenOptions::new()
                    .append(true)
                    .open(&kmsg)
                    .expect("open"),
            );
            let started = Instant::now();
            let mut written = 0u64;
            for tick in 0..10_000u64 {
                for i in 0..100u64 {
                    let n = tick * 100 + i;
                    let line = match n % 10 {
                        0 => format!(
                            "6,{n},{n},-;NVRM: GPU at PCI:0000:{:02x}:{:02x}: GPU-0a1b2c3d-0000-4000-8000-{n:012}",
                            n % 256,
                            (n / 256) % 32
                        ),
                        1 if n % 1000 == 1 => format!("4,{n},{n},-;{}", "x".repeat(8192)),
                        1..=6 => format!(
                            "4,{n},{n},-;NVRM: Xid (PCI:0000:01:00): {}, flood line {n}",
                            n % 200
                        ),
                        _ => format!("6,{n},{n},-;usb 1-1: something else entirely {n}"),
                    };
                    writeln!(log, "{line}").expect("write");
                    written += 1;
                }
                log.flush().expect("flush");
                // Paced to 100 lines a millisecond.
                let due = std::time::Duration::from_millis(tick + 1);
                if let Some(wait) = due.checked_sub(started.elapsed()) {
                    std::thread::sleep(wait);
                }
            }
            // The last line: once the agent reports it, it has read them all.
            writeln!(
                log,
                "4,0,0,-;NVRM: Xid (PCI:0000:01:00): 999, the last line of the flood"
            )
            .expect("write");
            log.flush().expect("flush");
            (written, started.elapsed())
        })
    };
    let mut peak = before;
    let sampling = async {
        loop {
            peak = peak.max(rss_kib(pid));
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    };
    let (written, took) = tokio::select! {
        done = flood => done.expect("the flood"),
        () = sampling => unreachable!("sampling never ends"),
    };
    let last = until(nodes, &node, WAIT, |n| {
        report(n).is_some_and(|r| {
            r.gpus
                .iter()
                .any(|g| g.xids.last().is_some_and(|x| x.code == 999))
        })
    })
    .await
    .expect("the agent read to the end of the flood");
    peak = peak.max(rss_kib(pid));
    let r = report(&last).expect("report");
    let metrics = agent.scrape().await.expect("metrics");
    let writes: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("gpuhealth_agent_report_writes_total "))
        .and_then(|v| v.trim().parse().ok())
        .expect("the report writes metric");
    let since_start = agent_started.elapsed();
    eprintln!(
        "flood: {written} lines in {took:?} ({:.0}/s); agent RSS {before} KiB before, {peak} KiB at peak; {} GPUs reported; {writes} report writes",
        written as f64 / took.as_secs_f64(),
        r.gpus.len()
    );
    assert!(
        r.gpus.len() <= 64,
        "the report stays within the contract: {}",
        r.gpus.len()
    );
    assert!(
        peak < before + 32 * 1024,
        "memory stays bounded under the flood: {before} KiB -> {peak} KiB"
    );
    // One write a second at most, besides those of a GPU newly gone bad,
    // which go at once: here the flood's Xids turn GPU 0 healthy and bad
    // again and again, and a coalesced write that found it healthy may be
    // followed by one that finds it bad, so at most two a second. Without
    // coalescing it was one write per Xid the API server could take, 300 to
    // 450 in ten seconds here.
    let bound = 2 * since_start.as_secs() + 2;
    assert!(
        writes <= bound,
        "{writes} report writes in {since_start:?}: coalesced to one a second"
    );
    drop(agent);
    remove_node(&client, &node).await;
}
