//! The real agent binary, NVML backend, on a simulated GPU node whose host
//! is stood in for at its outermost boundaries (`gpuhealth_e2e::host`): the
//! NVML library and nvidia-smi, the kernel log, the kubelet's PodResources,
//! the GPU Operator's device plugin and the system bus. Every line of the
//! agent runs as it would on a real node.
//!
//! Long because each test stands up a host of its own and drives the
//! agent through one story on it, and they share its helpers.

use std::time::Duration;

use gpuhealth_api::{
    GpuHealth, GpuNodeHealth, RecoveryAction,
    contract::{
        AnnotationValue, GPU_HEALTHY_CONDITION, GPU_REPORT_ANNOTATION, GpuReport, Outcome,
        REBOOT_REQUEST_ANNOTATION, REQUEST_RESULT_ANNOTATION, RebootMethod, RebootRequest,
        RequestResult,
    },
};
use gpuhealth_e2e::{
    client,
    host::{Agent, DEVICE_PLUGIN_LABEL, Host, uuid},
    in_flight, operator,
    process::capability_mask,
    scenario::{Scenario, WAIT},
    shipped::{Part, shipped, shipped_capabilities},
    sim::{is_cordoned, ready_gpu_node, remove_node},
    wait::{event_saying, until, within},
};
use k8s_openapi::{
    api::core::v1::{Node, Pod},
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::Timestamp,
};
use kube::{
    Api, Client, ResourceExt,
    api::{Patch, PatchParams},
};
use serde_json::json;

fn report(n: &Node) -> Option<GpuReport> {
    GpuReport::parse(n.annotations().get(GPU_REPORT_ANNOTATION)?).ok()
}

fn result(n: &Node) -> Option<RequestResult> {
    RequestResult::parse(n.annotations().get(REQUEST_RESULT_ANNOTATION)?).ok()
}

fn condition(n: &Node) -> Option<(String, String)> {
    n.status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == GPU_HEALTHY_CONDITION)
        .map(|c| (c.status.clone(), c.reason.clone().unwrap_or_default()))
}

fn allocatable_gpus(n: &Node) -> Option<String> {
    n.status
        .as_ref()?
        .allocatable
        .as_ref()?
        .get("nvidia.com/gpu")
        .map(|q| q.0.clone())
}

fn from_nvml(n: &Node) -> bool {
    report(n).is_some_and(|r| {
        r.source.as_deref() == Some("gpuhealth-agent/nvml") && r.unreadable.is_none()
    })
}

/// A Ready simulated node of eight GPUs and its host; no pods.
async fn bare_node(name: &str) -> (Client, String, Host) {
    let client = client().await.expect("client");
    let node = ready_gpu_node(&client, name).await.expect("a Ready node");
    let host = Host::new(&node, 8).expect("host");
    (client, node, host)
}

async fn request_reset(client: &Client, node: &str, id: &str, gpu: &str) {
    in_flight::request_reset(client, node, id, gpu, Timestamp::now())
        .await
        .expect("a reset request");
}

async fn annotate(client: &Client, node: &str, key: &str, value: &str) {
    let patch = json!({"metadata": {"annotations": {key: value}}});
    Api::<Node>::all(client.clone())
        .patch(node, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .expect("annotate");
}

async fn answered(client: &Client, node: &str, id: &str) -> RequestResult {
    let n = until(Api::<Node>::all(client.clone()), node, WAIT, |n| {
        result(n).is_some_and(|r| r.id.to_string() == id)
    })
    .await
    .unwrap_or_else(|e| panic!("an answer to {id}: {e}"));
    result(&n).expect("result")
}

/// Whether the report offers resets: the executor has said it can, and
/// the reporter reads NVML.
fn offers_resets(n: &Node) -> bool {
    report(n)
        .and_then(|r| r.capabilities)
        .is_some_and(|c| c.reset)
}

/// The agent's two parts on `host` with `extra` flags after those
/// `container-toolkit` ships.
async fn agent(host: &Host, name: &str, extra: &[&str]) -> Agent {
    host.start_agent(name, extra).await.expect("agent")
}

#[tokio::test]
async fn the_shipped_agent_takes_a_gpu_from_its_xid_back_to_serving_beside_the_gpu_operator() {
    let mut s = Scenario::new("nvml-e2e", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    let nodes: Api<Node> = Api::all(s.client.clone());
    let mut host = Host::new(&node, 8).expect("host");
    host.kubelet(&s.client).expect("the kubelet's PodResources");
    host.device_plugin(&s.client)
        .await
        .expect("the device plugin");
    host.system_bus().await.expect("the system bus");

    // Exactly the flags the default install ships, and the environment its
    // runtime gives the container.
    for part in Part::BOTH {
        let (_, env) = shipped("container-toolkit", part).await.expect("shipped");
        assert_eq!(
            env.get("NVIDIA_VISIBLE_DEVICES").map(String::as_str),
            Some("all"),
            "{part:?}"
        );
    }
    let _agent = host
        .start_agent(&format!("{node}-agent"), &[])
        .await
        .expect("agent");
    let n = until(nodes.clone(), &node, WAIT, |n| {
        from_nvml(n)
            && report(n).is_some_and(|r| r.gpus.iter().filter(|g| !g.pods.is_empty()).count() == 8)
            && allocatable_gpus(n).as_deref() == Some("8")
            && offers_resets(n)
    })
    .await
    .expect("the agent's report, every GPU's pod named by the kubelet, with the executor's offer");
    let r = report(&n).expect("report");
    assert_eq!(r.gpus.len(), 8);
    assert_eq!(
        r.capabilities.map(|c| (c.reset, c.reboot)),
        Some((true, RebootMethod::Logind))
    );
    let on_gpu7 = r.gpus[7].pods[0].name.clone();
    let on_others: Vec<String> = r.gpus[..7].iter().map(|g| g.pods[0].name.clone()).collect();

    s.operator = Some(
        operator::start_with(&format!("operator-{}", s.group), s.operator_options.clone())
            .await
            .expect("operator"),
    );
    s.wait_taken_in().await.expect("taken in");

    host.incident_fault(7).expect("GPU 7's Xids 119 and 154");
    until(nodes.clone(), &node, WAIT, |n| {
        allocatable_gpus(n).as_deref() == Some("7")
    })
    .await
    .expect("the device plugin withdraws GPU 7");

    let status = s.wait_recovered(&node).await.expect("back to Healthy");
    let incident = status.history.first().expect("the incident");
    assert_eq!(incident.gpus, [uuid(7)]);
    let pods: Api<Pod> = Api::namespaced(s.client.clone(), &s.namespace);
    assert!(
        pods.get_opt(&on_gpu7).await.expect("pod").is_none(),
        "GPU 7's pod moved"
    );
    for pod in &on_others {
        let p = pods.get_opt(pod).await.expect("pod");
        assert!(
            p.is_some_and(|p| p.metadata.deletion_timestamp.is_none()),
            "{pod}, on a healthy GPU, stayed"
        );
    }

    // One reset, of GPU 7, carried out once; the operands back; every GPU
    // offered again; the node serving.
    assert_eq!(host.resets(), [(uuid(7), "ok".to_owned())]);
    let n = nodes.get(&node).await.expect("node");
    let r = result(&n).expect("the reset's result");
    assert_eq!(r.outcome, Outcome::Succeeded, "{r:?}");
    for said in [
        "NVML reads it back with nothing more to do",
        "paused and restored: nvidia.com/gpu.deploy.device-plugin",
        "offers 8 of 8 nvidia.com/gpu",
    ] {
        assert!(r.message.contains(said), "{said:?} in {:?}", r.message);
    }
    assert_eq!(
        n.labels().get(DEVICE_PLUGIN_LABEL).map(String::as_str),
        Some("true")
    );
    assert!(host.device_plugin_running());
    assert_eq!(allocatable_gpus(&n).as_deref(), Some("8"));
    assert!(!is_cordoned(&n));
    let r = report(&n).expect("report");
    assert_eq!(r.gpus[7].health, GpuHealth::Healthy);
    assert!(
        r.gpus[7].xids.is_empty(),
        "the answered Xids are gone: {:?}",
        r.gpus[7].xids
    );

    // The next fault, on another GPU, right after the recovery, is reported
    // and answered the same way (an Xid in the second the incident closed
    // was once taken as answered by it).
    host.xid(
        3,
        119,
        "Timeout after 45s of waiting for RPC response from GPU GSP",
        Duration::ZERO,
    )
    .expect("Xid 119 on GPU 3");
    until(nodes.clone(), &node, WAIT, |n| {
        report(n).is_some_and(|r| r.gpus[3].xids.iter().any(|x| x.code == 119))
    })
    .await
    .expect("GPU 3's Xid reported");
    until(nodes, &node, WAIT, is_cordoned)
        .await
        .expect("cordoned for GPU 3");
    // The cordon is written before the record that opens its incident:
    // the record is waited for.
    let records: Api<GpuNodeHealth> = Api::all(s.client.clone());
    until(records, &node, WAIT, |g| {
        g.status
            .as_ref()
            .and_then(|s| s.history.first())
            .is_some_and(|i| i.id != incident.id && i.gpus == [uuid(3)])
    })
    .await
    .expect("a new incident, about GPU 3");
}

/// The GPU Operator's driver container runs nvidia-persistenced, which
/// holds every GPU in persistence mode, and the driver refuses a reset
/// while it does: the agent turns persistence mode off for the GPU (the
/// daemon lets it go), resets it, and turns it on again.
#[tokio::test]
async fn a_gpu_nvidia_persistenced_holds_is_let_go_reset_and_held_again() {
    let (client, node, mut host) = bare_node("nvml-persistenced").await;
    host.persistenced().await.expect("nvidia-persistenced");
    assert_eq!(host.get(4, "persistence").as_deref(), Some("1"));
    let agent = agent(&host, &format!("{node}-agent"), &["--let-go=5s"]).await;
    let nodes: Api<Node> = Api::all(client.clone());
    until(nodes.clone(), &node, WAIT, from_nvml)
        .await
        .expect("a report");
    // Each part with only the capabilities its own container adds.
    for (part, process) in [
        (Part::Reporter, &agent.reporter),
        (Part::Executor, &agent.executor),
    ] {
        let shipped = shipped_capabilities("container-toolkit", part)
            .await
            .expect("shipped");
        let expected = capability_mask(&shipped).expect("known capabilities");
        let held = process.capabilities().expect("its capabilities");
        assert_eq!(
            (held.effective, held.bounding, held.no_new_privileges),
            (expected, expected, true),
            "{part:?}: {held:?}, shipped {shipped:?}"
        );
    }
    // The reporter holds every GPU through NVML (the stand-in's nvidia-smi,
    // as the driver, refuses a GPU anyone holds): the executor's reset asks
    // it to let go, and it reports again after.
    request_reset(&client, &node, "inc-1-reset-1", &uuid(4)).await;
    let r = answered(&client, &node, "inc-1-reset-1").await;
    assert_eq!(r.outcome, Outcome::Succeeded, "{r:?}");
    // It takes NVML back within a second or so of the executor's word,
    // which may come after the result.
    within("the reporter taking NVML back", WAIT, async {
        while !agent
            .reporter
            .log_text()
            .contains("took NVML back after the executor's reset")
        {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(())
    })
    .await
    .expect("the reporter took NVML back");
    assert!(
        agent
            .reporter
            .log_text()
            .contains("let go of NVML for the executor's reset"),
        "the reporter let go"
    );
    host.set(4, "recovery_action", "1")
        .expect("GPU 4 breaks again");
    until(nodes, &node, WAIT, |n| {
        report(n).is_some_and(|r| r.gpus[4].health == GpuHealth::ResetRequired)
    })
    .await
    .expect("the reporter reads NVML again after the reset");
    assert!(
        r.message
            .contains("persistence mode turned off for it and on again"),
        "{}",
        r.message
    );
    assert_eq!(host.resets(), [(uuid(4), "ok".to_owned())]);
    assert_eq!(
        host.get(4, "persistence").as_deref(),
        Some("1"),
        "held again"
    );
    remove_node(&client, &node).await;
}

#[tokio::test]
async fn a_held_gpu_is_refused_naming_its_holder_and_a_hung_nvidia_smi_is_stopped() {
    let (client, node, host) = bare_node("nvml-refusals").await;
    let agent = agent(
        &host,
        &format!("{node}-agent"),
        &["--let-go=2s", "--reset-timeout=3s"],
    )
    .await;
    let nodes: Api<Node> = Api::all(client.clone());
    let n = until(nodes.clone(), &node, WAIT, |n| {
        from_nvml(n) && offers_resets(n)
    })
    .await
    .expect("a report with the executor's offer");
    // No system bus on this host: the report offers resets (NVML answers,
    // nvidia-smi runs) and no reboot, whatever --reboot-method says.
    assert_eq!(
        report(&n)
            .and_then(|r| r.capabilities)
            .map(|c| (c.reset, c.reboot)),
        Some((true, RebootMethod::None))
    );

    // A process no one paused holds GPU 3: named, and nothing is tried.
    let holder = host.hold(3).await.expect("a holder");
    let pid = holder.id().expect("pid");
    request_reset(&client, &node, "inc-1-reset-1", &uuid(3)).await;
    let r = answered(&client, &node, "inc-1-reset-1").await;
    assert_eq!(r.outcome, Outcome::Refused, "{r:?}");
    assert!(
        r.message.contains(&format!("sleep (pid {pid})")),
        "{}",
        r.message
    );
    assert!(r.message.contains("nothing tried"), "{}", r.message);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(host.resets(), [], "nvidia-smi never ran");
    assert_eq!(
        result(&nodes.get(&node).await.expect("node")).map(|r| r.id.to_string()),
        Some("inc-1-reset-1".to_owned()),
        "not retried"
    );
    drop(holder);

    // nvidia-smi hangs on GPU 2: stopped at the deadline, and the agent
    // goes on reading and reporting.
    host.set(2, "reset", "hang").expect("hang");
    request_reset(&client, &node, "inc-2-reset-1", &uuid(2)).await;
    let r = answered(&client, &node, "inc-2-reset-1").await;
    assert_eq!(r.outcome, Outcome::Failed, "{r:?}");
    assert!(
        r.message.contains("did not finish within 3s"),
        "{}",
        r.message
    );
    host.set(5, "recovery_action", "1").expect("GPU 5 breaks");
    until(nodes, &node, WAIT, |n| {
        report(n).is_some_and(|r| r.gpus[5].health == GpuHealth::ResetRequired)
    })
    .await
    .expect("the agent keeps serving");
    let (status, _) = agent
        .reporter
        .get("/livez", |s| s == 200)
        .await
        .expect("alive");
    assert_eq!(status, 200);
    remove_node(&client, &node).await;
}

/// An executor without the access it needs offers no reset and no
/// reboot, and says which check failed. Here its container lacks
/// `CAP_SYS_PTRACE` and `CAP_SYS_BOOT`: the open files of a process
/// outside it (its parent's, a root process with every capability) cannot
/// be followed, as under a runtime's default AppArmor profile or SELinux
/// type, and logind answers `CanReboot` with `challenge`. The reasons reach
/// the reporter's log, the executor's metric and Warning Events on the
/// Node. The same executor run with its manifest's access offers both.
#[tokio::test]
async fn an_executor_without_the_access_it_needs_withholds_its_offer_and_says_why() {
    let (client, node, mut host) = bare_node("nvml-withheld").await;
    host.system_bus().await.expect("the system bus");
    let nodes: Api<Node> = Api::all(client.clone());
    let lacking = ["sys_ptrace", "sys_boot"];
    let mut agent = host
        .start_agent_short_of(&format!("{node}-agent"), &[], &lacking)
        .await
        .expect("agent");
    let mut kept = shipped_capabilities("container-toolkit", Part::Executor)
        .await
        .expect("shipped");
    kept.retain(|c| !lacking.contains(&c.as_str()));
    let held = agent.executor.capabilities().expect("its capabilities");
    assert_eq!(
        held.effective,
        capability_mask(&kept).expect("known capabilities"),
        "{held:?}"
    );

    for (check, says) in [
        (
            "HostProcesses",
            "the check HostProcesses fails: cannot follow /proc/",
        ),
        ("Logind", "answers CanReboot with \"challenge\""),
    ] {
        event_saying(&client, &node, "CapabilityWithheld", says)
            .await
            .unwrap_or_else(|e| panic!("{check} on the Node's Events: {e}"));
    }
    let metrics = agent.executor.scrape().await.expect("metrics");
    for (capability, check, value) in [
        ("reset", "HostProcesses", 1),
        ("reset", "NvidiaSmi", 0),
        ("reboot", "Logind", 1),
    ] {
        let line = format!(
            "gpuhealth_agent_capability_withheld{{capability=\"{capability}\",check=\"{check}\"}} {value}"
        );
        assert!(metrics.contains(&line), "{line} in:\n{metrics}");
    }
    // The reporter reads the offer, and why, and its report offers neither.
    within("the reporter saying why", WAIT, async {
        loop {
            let log = agent.reporter.log_text();
            if log.contains("no resets: cannot follow /proc/")
                && log.contains("CAP_SYS_PTRACE")
                && log.contains("no reboots: systemd-logind")
            {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
    .expect("the reporter logs the reasons");
    let n = until(nodes.clone(), &node, WAIT, from_nvml)
        .await
        .expect("a report");
    assert_eq!(
        report(&n)
            .and_then(|r| r.capabilities)
            .map(|c| (c.reset, c.reboot)),
        Some((false, RebootMethod::None))
    );

    // With its manifest's access: both offered, nothing withheld.
    agent.executor.kill().await;
    agent.executor = host
        .start_executor(&format!("{node}-executor-2"), &[], &[])
        .await
        .expect("executor");
    until(nodes, &node, WAIT, |n| {
        from_nvml(n)
            && report(n)
                .and_then(|r| r.capabilities)
                .is_some_and(|c| c.reset && c.reboot == RebootMethod::Logind)
    })
    .await
    .expect("a report offering a reset and a reboot");
    let metrics = agent.executor.scrape().await.expect("metrics");
    for check in ["HostProcesses", "Logind"] {
        assert!(
            metrics.contains(&format!("check=\"{check}\"}} 0")),
            "{check} passes: {metrics}"
        );
    }
    remove_node(&client, &node).await;
}

/// While NVML's Xid events are up, the kernel log alone is not believed
/// (a tenant's process can print into it): an Xid only the log shows is
/// reported `uncorroborated` (never acted on), where the same Xid from
/// the driver, in the log and through NVML, is reported as it is.
#[tokio::test]
async fn an_xid_only_the_kernel_log_shows_is_reported_uncorroborated() {
    let (client, node, host) = bare_node("nvml-doubt").await;
    let nodes: Api<Node> = Api::all(client.clone());
    let _agent = agent(&host, &format!("{node}-agent"), &[]).await;
    // An event NVML alone reports shows its events are up.
    host.nvml_xid(2, 13).expect("an NVML event");
    until(nodes.clone(), &node, WAIT, |n| {
        from_nvml(n) && report(n).is_some_and(|r| r.gpus[2].xids.iter().any(|x| x.code == 13))
    })
    .await
    .expect("NVML's events up");

    host.kernel_log_xid(5, 79, "GPU has fallen off the bus.", Duration::ZERO)
        .expect("a line in the kernel log alone");
    host.xid(6, 48, "DBE (Double Bit Error) ECC Error", Duration::ZERO)
        .expect("an Xid from the driver, both ways");
    let n = until(nodes, &node, WAIT, |n| {
        report(n).is_some_and(|r| {
            r.gpus[5].xids.iter().any(|x| x.code == 79)
                && r.gpus[6].xids.iter().any(|x| x.code == 48)
        })
    })
    .await
    .expect("both reported");
    let r = report(&n).expect("report");
    let xid = |gpu: usize, code: u32| {
        r.gpus[gpu]
            .xids
            .iter()
            .find(|x| x.code == code)
            .cloned()
            .expect("reported")
    };
    assert!(xid(5, 79).uncorroborated, "{:?}", r.gpus[5]);
    assert!(!xid(6, 48).uncorroborated, "{:?}", r.gpus[6]);
    assert_eq!(
        xid(6, 48).text,
        "DBE (Double Bit Error) ECC Error",
        "the line's words"
    );
    remove_node(&client, &node).await;
}

#[tokio::test]
async fn xids_from_before_the_last_recovery_do_not_act_again_after_a_restart() {
    let (client, node, host) = bare_node("nvml-fresh").await;
    let nodes: Api<Node> = Api::all(client.clone());
    // Logged a minute ago, before the agent started: the ring buffer replays it.
    host.set(7, "recovery_action", "1")
        .expect("recovery action");
    host.xid(
        7,
        119,
        "Timeout after 45s of waiting for RPC response from GPU GSP",
        Duration::from_secs(60),
    )
    .expect("Xid");
    let mut first = agent(&host, &format!("{node}-agent"), &[]).await;
    until(nodes.clone(), &node, WAIT, |n| {
        from_nvml(n)
            && report(n).is_some_and(|r| {
                r.gpus[7].health == GpuHealth::ResetRequired
                    && r.gpus[7].xids.iter().any(|x| x.code == 119)
            })
    })
    .await
    .expect("GPU 7 reported with its Xid");
    request_reset(&client, &node, "inc-1-reset-1", &uuid(7)).await;
    let r = answered(&client, &node, "inc-1-reset-1").await;
    assert_eq!(r.outcome, Outcome::Succeeded, "{r:?}");
    until(nodes.clone(), &node, WAIT, |n| {
        report(n)
            .is_some_and(|r| r.gpus[7].health == GpuHealth::Healthy && r.gpus[7].xids.is_empty())
    })
    .await
    .expect("healthy, the Xid answered");

    // A new agent reads the whole kernel log again: the old Xid stays
    // answered; a new one counts.
    first.kill().await;
    // A second later, so that the new agent's first report is told apart
    // by its time (reports are stamped to the second).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let restarted = Timestamp::now().as_second();
    let _second = agent(&host, &format!("{node}-agent-2"), &[]).await;
    let n = until(nodes.clone(), &node, WAIT, |n| {
        from_nvml(n) && report(n).is_some_and(|r| r.observed_at.0.as_second() >= restarted)
    })
    .await
    .expect("the restarted agent's report, from the whole kernel log");
    let r = report(&n).expect("report");
    assert!(r.gpus[7].xids.is_empty(), "replayed: {:?}", r.gpus[7].xids);
    host.xid(7, 48, "DBE (Double Bit Error) ECC Error", Duration::ZERO)
        .expect("Xid 48");
    until(nodes, &node, WAIT, |n| {
        report(n).is_some_and(|r| r.gpus[7].xids.iter().map(|x| x.code).collect::<Vec<_>>() == [48])
    })
    .await
    .expect("a fresh Xid counts");
    remove_node(&client, &node).await;
}

#[tokio::test]
async fn a_reboot_on_the_shipped_default_reaches_logind_once() {
    let (client, node, mut host) = bare_node("nvml-reboot").await;
    host.system_bus().await.expect("the system bus");
    let nodes: Api<Node> = Api::all(client.clone());
    let mut first = host
        .start_agent(&format!("{node}-agent"), &[])
        .await
        .expect("agent");
    until(nodes.clone(), &node, WAIT, from_nvml)
        .await
        .expect("a report");
    in_flight::record(
        &client,
        &node,
        RecoveryAction::NodeReboot,
        "inc-1-reboot-1",
        &[],
    )
    .await
    .expect("recorded in flight");
    let request = RebootRequest {
        id: "inc-1-reboot-1".parse().expect("id"),
        requested_at: Time(Timestamp::now()),
    };
    annotate(
        &client,
        &node,
        REBOOT_REQUEST_ANNOTATION,
        &request.to_annotation(),
    )
    .await;
    let r = answered(&client, &node, "inc-1-reboot-1").await;
    assert_eq!(r.outcome, Outcome::Succeeded, "{r:?}");
    assert!(
        r.message.contains("systemd-logind accepted"),
        "{}",
        r.message
    );
    assert_eq!(*host.reboots.lock().expect("count"), 1);

    // The node would now go down; an agent starting again never asks twice.
    first.kill().await;
    let _second = host
        .start_agent(&format!("{node}-agent-2"), &[])
        .await
        .expect("agent");
    annotate(&client, &node, "e2e.gpuhealth.io/touch", "after-restart").await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(*host.reboots.lock().expect("count"), 1, "asked once");
    remove_node(&client, &node).await;
}

#[tokio::test]
async fn a_hung_nvml_and_an_overwritten_report_are_seen_and_mended() {
    let (client, node, host) = bare_node("nvml-unreadable").await;
    let agent = agent(&host, &format!("{node}-agent"), &["--nvml-deadline=2s"]).await;
    let nodes: Api<Node> = Api::all(client.clone());
    until(nodes.clone(), &node, WAIT, from_nvml)
        .await
        .expect("a report");

    // Another writer overwrites the report: put back.
    let mut foreign = report(&nodes.get(&node).await.expect("node")).expect("report");
    foreign.source = Some("someone-else".into());
    foreign.gpus.truncate(1);
    annotate(
        &client,
        &node,
        GPU_REPORT_ANNOTATION,
        &foreign.to_annotation(),
    )
    .await;
    until(nodes.clone(), &node, WAIT, |n| {
        from_nvml(n) && report(n).is_some_and(|r| r.gpus.len() == 8)
    })
    .await
    .expect("the agent's report put back");

    // NVML hangs on GPU 4: the agent says the GPUs cannot be read, keeps
    // the last ones it read, and is alive but not ready.
    host.set(4, "hang", "1").expect("hang");
    let n = until(nodes.clone(), &node, WAIT, |n| {
        report(n).is_some_and(|r| r.unreadable.is_some())
            && condition(n).is_some_and(|(s, _)| s == "Unknown")
    })
    .await
    .expect("unreadable said");
    let r = report(&n).expect("report");
    assert!(
        r.unreadable
            .as_deref()
            .unwrap_or_default()
            .contains("did not answer within 2s"),
        "{r:?}"
    );
    assert_eq!(r.gpus.len(), 8, "the last GPUs read stand");
    assert_eq!(
        condition(&n).map(|(_, reason)| reason).as_deref(),
        Some("GpusUnreadable")
    );
    agent
        .reporter
        .get("/readyz", |s| s == 503)
        .await
        .expect("not ready");
    agent
        .reporter
        .get("/livez", |s| s == 200)
        .await
        .expect("alive");

    host.set(4, "hang", "0").expect("unhung");
    until(nodes, &node, WAIT, |n| {
        from_nvml(n) && condition(n).is_some_and(|(s, _)| s == "True")
    })
    .await
    .expect("readable again");
    agent
        .reporter
        .get("/readyz", |s| s == 200)
        .await
        .expect("ready");
    remove_node(&client, &node).await;
}
