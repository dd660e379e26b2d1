//! Newcomers on a fenced GPU, on the real API server: a pod that comes to
//! hold a bad GPU after gpuhealth judged it bad is drained under the same
//! rules as its first holders, and the reset is requested only once it is
//! gone. On a DRA node the real scheduler gives the device out (in the gap
//! of a deleted rule, or racing the report); on a device-plugin node the
//! report names a pod the kubelet started on the GPU. The order is read
//! from an independent watcher of the cluster ([`Recorder`]), never from
//! the operator.

use gpuhealth_api::{contract::PodRef, node_health::Phase, quarantine::RULE_NODE_LABEL};
use gpuhealth_e2e::{
    dra,
    invariants::{Seen, ending, fences_up},
    recorder::Recorder,
    reports,
    scenario::{Scenario, WAIT},
    wait::{until, until_set},
};
use k8s_openapi::{
    api::{
        core::v1::{Container, Node, Pod, PodSpec, Toleration},
        policy::v1::PodDisruptionBudget,
    },
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use kube::{
    Api,
    api::{DeleteParams, Patch, PatchParams, PostParams},
    runtime::watcher,
};
use serde_json::json;

/// `timeline` but the hardware and pods seen up, one line each: what a
/// failed assertion shows.
fn said(timeline: &[Seen]) -> String {
    timeline
        .iter()
        .enumerate()
        .filter(|(_, s)| !matches!(s, Seen::Hardware { .. } | Seen::PodUp { .. }))
        .map(|(i, s)| format!("\n  {i}: {s:?}"))
        .collect()
}

/// Where in `timeline` `pod` (`namespace/name`) was seen gone.
fn gone_at(timeline: &[Seen], pod: &str) -> Option<usize> {
    timeline
        .iter()
        .position(|s| matches!(s, Seen::PodGone { pod: p, .. } if p == pod))
}

/// Where in `timeline` the first reset or reboot request on `node` was
/// seen.
fn requested_at(timeline: &[Seen], node: &str) -> Option<usize> {
    timeline
        .iter()
        .position(|s| matches!(s, Seen::Request { node: n, .. } if n == node))
}

/// Where in `timeline` `pod`'s claim was seen allocated GPU `gpu`.
fn claimed_at(timeline: &[Seen], pod: &str, gpu: u32) -> Option<usize> {
    let device = dra::device_name(gpu);
    timeline.iter().position(
        |s| matches!(s, Seen::Claimed { pod: p, device: d, .. } if p == pod && *d == device),
    )
}

/// Waits until gpuhealth has a rule up for `node`.
async fn rule_up(s: &Scenario, node: &str) {
    until_set(
        dra::rules(&s.client).await.expect("rules"),
        watcher::Config::default().labels(&format!("{RULE_NODE_LABEL}={node}")),
        "gpuhealth's rule up",
        WAIT,
        |set| !set.is_empty(),
    )
    .await
    .expect("a rule");
}

/// A recorder of the scenario's nodes, pods, rules and claims, listing.
async fn recorder(s: &Scenario) -> Recorder {
    let mut recorder = Recorder::start(&s.client, &s.group, &s.namespace);
    recorder.ready().await.expect("the recorder lists");
    recorder
}

/// The gap before the request: GPU 7's holder is kept by its disruption
/// budget while its rule is deleted and the scheduler gives GPU 7 to a
/// pending pod. Once the budget allows, both are drained, and the reset is
/// requested only after the newcomer is gone.
#[tokio::test]
async fn a_pod_given_the_bad_gpu_while_its_rule_was_gone_is_drained_before_the_reset_is_asked_for()
{
    let mut s = Scenario::new_dra("dra-gap-drain", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    dra::claiming_pod(&s.client, &s.namespace, &s.group, "holder-7", Some(7))
        .await
        .expect("GPU 7's holder");
    assert_eq!(
        dra::device_of(&s.client, &s.namespace, "holder-7")
            .await
            .expect("a claim allocated"),
        "gpu-7"
    );
    s.add_pdb_selecting("keep", "dra", 0)
        .await
        .expect("a budget that allows no disruption");
    let recorder = recorder(&s).await;
    s.start().await.expect("operator and agent");
    let mut report = reports::healthy(&s.namespace, &[]);
    reports::xid_119_and_154(&mut report, 7);
    s.write_report(&node, report).await.expect("report");
    s.wait_status(&node, "draining, held by the budget", |st| {
        st.phase == Phase::Draining
    })
    .await
    .expect("draining");
    rule_up(&s, &node).await;

    let operator = s.operator.as_ref().expect("the operator runs");
    operator.stall().await.expect("the operator stalled");
    dra::delete_fences(&s.client, &node)
        .await
        .expect("the rules deleted");
    dra::claiming_pod(&s.client, &s.namespace, &s.group, "newcomer", Some(7))
        .await
        .expect("a pod wanting GPU 7");
    let given = dra::device_of(&s.client, &s.namespace, "newcomer")
        .await
        .expect("a claim allocated");
    operator.resume().await.expect("the operator goes on");
    assert_eq!(given, "gpu-7", "the scheduler gave the newcomer GPU 7");

    rule_up(&s, &node).await;
    Api::<PodDisruptionBudget>::namespaced(s.client.clone(), &s.namespace)
        .delete("keep", &DeleteParams::default())
        .await
        .expect("the budget lifted");
    s.wait_recovered(&node).await.expect("recovered");
    let timeline = recorder.since(0);
    let newcomer = format!("{}/newcomer", s.namespace);
    let (claimed, gone, requested) = (
        claimed_at(&timeline, &newcomer, 7),
        gone_at(&timeline, &newcomer),
        requested_at(&timeline, &node),
    );
    assert!(claimed.is_some(), "the watcher saw the newcomer's claim");
    assert!(
        gone.is_some() && gone < requested,
        "the newcomer gone (at {gone:?}) before the reset was asked for (at {requested:?}):{}",
        said(&timeline)
    );
}

/// The report and a new claim for the bad GPU arrive together, GPU after
/// GPU, until the scheduler has given the racer the bad GPU twice (before
/// the rule stopped it): each time the racer is drained before the reset
/// is asked for. A racer that lost waits for the GPU until its rule goes.
#[tokio::test]
async fn a_claim_racing_the_report_never_holds_the_bad_gpu_when_its_reset_is_asked_for() {
    // Incident after incident on one node: no limit or cooldown between.
    let mut spec = Scenario::quick_spec();
    spec.remediation_limits.per_gpu = 0;
    spec.remediation_limits.per_node = 0;
    spec.remediation_limits.cooldown = gpuhealth_api::Duration::from_secs(0);
    let mut s = Scenario::new_dra("dra-race", 1, spec)
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    let recorder = recorder(&s).await;
    s.start().await.expect("operator and agent");
    let mut won = Vec::new();
    for gpu in 0..8u32 {
        let mark = recorder.mark();
        let racer = format!("racer-{gpu}");
        let mut report = reports::healthy(&s.namespace, &[]);
        reports::xid_119_and_154(&mut report, gpu as usize);
        let (reported, claimed) = tokio::join!(
            s.write_report(&node, report),
            dra::claiming_pod(&s.client, &s.namespace, &s.group, &racer, Some(gpu)),
        );
        reported.expect("report");
        claimed.expect("the racer");
        let over = recorder
            .until(mark, "the incident over, its rule gone", WAIT, |t| {
                ending(t, &node) == Some(Phase::Healthy) && fences_up(t, &node) == 0
            })
            .await;
        if let Err(e) = over {
            panic!("GPU {gpu}: {e}:{}", said(&recorder.since(mark)));
        }
        let timeline = recorder.since(mark);
        let racer = format!("{}/{racer}", s.namespace);
        let rule_gone = timeline
            .iter()
            .position(|s| matches!(s, Seen::Fence { up: false, .. }));
        let claimed = claimed_at(&timeline, &racer, gpu);
        if claimed.is_some() && claimed < rule_gone {
            let (gone, requested) = (gone_at(&timeline, &racer), requested_at(&timeline, &node));
            assert!(
                gone.is_some() && gone < requested,
                "GPU {gpu}: the racer, given the bad GPU, gone (at {gone:?}) before its reset was asked for (at {requested:?}):{}",
                said(&timeline)
            );
            won.push(gpu);
            if won.len() == 2 {
                break;
            }
        }
    }
    eprintln!("the scheduler gave the racer the bad GPU for GPUs {won:?}");
    assert!(
        !won.is_empty(),
        "the scheduler never won the race in 8 rounds: the window went untested"
    );
}

/// A bare pod on `node` (as the kubelet runs one it admitted), labelled
/// `app: late` so that no budget of the test's covers it.
async fn pod_on(s: &Scenario, node: &str, name: &str) {
    let pod = Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some([("app".to_owned(), "late".to_owned())].into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            termination_grace_period_seconds: Some(1),
            containers: vec![Container {
                name: "server".into(),
                image: Some("vllm/vllm-openai:latest".into()),
                ..Default::default()
            }],
            tolerations: Some(vec![Toleration {
                operator: Some("Exists".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    Api::<Pod>::namespaced(s.client.clone(), &s.namespace)
        .create(&PostParams::default(), &pod)
        .await
        .expect("a pod on the node");
}

/// The device-plugin twin: GPU 7 fenced by the plugin's withdrawal, its
/// holder kept by a budget. A pod the kubelet started on GPU 7 meanwhile
/// (the report names it) is drained before the reset is asked for; one it
/// starts there while the reset is in flight is drained before it runs.
#[tokio::test]
async fn a_pod_the_report_names_on_a_withdrawn_gpu_is_drained_before_and_while_its_reset() {
    let mut s = Scenario::new("plugin-newcomer", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    if let Ok(mut answer) = s.agent.reset.lock() {
        *answer = gpuhealth_e2e::agent::Answer::Hold;
    }
    s.add_pdb("keep", 0).await.expect("a budget over vLLM");
    let recorder = recorder(&s).await;
    s.start().await.expect("operator and agent");
    let status = json!({"status": {"allocatable": {"nvidia.com/gpu": "7"}}});
    Api::<Node>::all(s.client.clone())
        .patch_status(&node, &PatchParams::default(), &Patch::Merge(status))
        .await
        .expect("the plugin withdrew GPU 7");
    let pods = s.pods_on(&node).await.expect("pods");
    let first = pods[7].clone();
    // The report as the agent writes it: GPU 7 bad, with its holders.
    let report_with = |extra: &[&str]| {
        let mut report = reports::healthy(&s.namespace, &pods);
        reports::xid_119_and_154(&mut report, 7);
        report.gpus[7].pods.extend(extra.iter().map(|p| PodRef {
            namespace: s.namespace.clone(),
            name: (*p).to_owned(),
            container: Some("server".into()),
        }));
        report
    };
    s.write_report(&node, report_with(&[]))
        .await
        .expect("report");
    s.wait_status(&node, "draining, held by the budget", |st| {
        st.phase == Phase::Draining
    })
    .await
    .expect("draining");

    pod_on(&s, &node, "late-1").await;
    s.write_report(&node, report_with(&["late-1"]))
        .await
        .expect("the report names late-1 on GPU 7");
    Api::<PodDisruptionBudget>::namespaced(s.client.clone(), &s.namespace)
        .delete("keep", &DeleteParams::default())
        .await
        .expect("the budget lifted");
    recorder
        .until(0, "the reset asked for", WAIT, |t| {
            requested_at(t, &node).is_some()
        })
        .await
        .expect("the reset asked for");
    let timeline = recorder.since(0);
    let late = format!("{}/late-1", s.namespace);
    let (gone, requested) = (gone_at(&timeline, &late), requested_at(&timeline, &node));
    assert!(
        gone.is_some() && gone < requested,
        "late-1 gone (at {gone:?}) before the reset was asked for (at {requested:?}):{}",
        said(&timeline)
    );
    assert!(
        gone_at(&timeline, &format!("{}/{first}", s.namespace)) < requested,
        "the first holder gone before the reset too"
    );

    // While the reset is held in flight, the kubelet starts another pod
    // on GPU 7: drained before the reset goes ahead.
    pod_on(&s, &node, "late-2").await;
    let pods_api: Api<Pod> = Api::namespaced(s.client.clone(), &s.namespace);
    until(pods_api.clone(), "late-2", WAIT, |p| {
        p.status.as_ref().and_then(|st| st.phase.as_deref()) == Some("Running")
    })
    .await
    .expect("late-2 running");
    s.write_report(&node, report_with(&["late-2"]))
        .await
        .expect("the report names late-2 on GPU 7");
    until_set(
        pods_api,
        watcher::Config::default(),
        "late-2 gone",
        WAIT,
        |set| !set.contains_key("late-2"),
    )
    .await
    .expect("late-2 evicted while the reset is in flight");
    s.agent
        .release(&s.client, &node)
        .await
        .expect("the reset goes ahead");
    s.wait_recovered(&node).await.expect("recovered");
}
