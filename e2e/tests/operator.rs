//! The operator process itself on the real API server: crashes at the worst
//! moments, two replicas behind one Lease, overlapping policies, policies
//! it cannot honour as written, and the cluster's guardrails over them.
//!
//! Long because each test is one story of the operator process, and they
//! share the helpers that read its Lease, its policy's conditions and its
//! Events.

use std::time::{Duration, Instant};

use gpuhealth_api::{
    GpuHealthPolicy, RecoveryAction,
    contract::{AnnotationValue, ResetRequest},
    node_health::Phase,
    policy::{DrainScope, MaintenanceWindow, SignalSource},
    vocabulary::{Attempt, AttemptOutcome, Reason},
};
use gpuhealth_e2e::{
    agent::Answer,
    cluster::{self, kubeconfig_with_token},
    identities,
    operator::{self, LEASE_DURATION, Options, RETRY_PERIOD},
    proxy::Proxy,
    scenario::{Scenario, WAIT},
    sim::is_cordoned,
    wait::until,
};
use k8s_openapi::api::{
    coordination::v1::Lease,
    core::v1::{Event, Namespace, Node, Pod},
    rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule},
};
use k8s_openapi::apimachinery::pkg::{apis::meta::v1::Condition, util::intstr::IntOrString};
use kube::{
    Api,
    api::{ListParams, Patch, PatchParams, PostParams},
};
use serde::Deserialize;
use serde_json::json;

/// The Lease of `name` held by `holder`.
async fn lease_held_by(s: &Scenario, name: &str, holder: &str, timeout: Duration) {
    let leases: Api<Lease> = Api::namespaced(s.client.clone(), "default");
    until(leases, name, timeout, |l| {
        l.spec.as_ref().and_then(|s| s.holder_identity.as_deref()) == Some(holder)
    })
    .await
    .unwrap_or_else(|e| panic!("lease {name} held by {holder}: {e}"));
}

/// The replicas that published gpuhealth's Events about `node`.
async fn event_reporters(s: &Scenario, node: &str) -> Vec<String> {
    let events: Api<Event> = Api::all(s.client.clone());
    let list = events
        .list(&ListParams::default().fields(&format!("involvedObject.name={node}")))
        .await
        .expect("events");
    let mut reporters: Vec<String> = list
        .items
        .iter()
        .filter(|e| e.reporting_component.as_deref() == Some("gpuhealth-operator"))
        .filter_map(|e| e.reporting_instance.clone())
        .collect();
    reporters.sort();
    reporters.dedup();
    reporters
}

#[tokio::test]
async fn a_crash_in_any_phase_is_resumed_and_no_request_is_repeated() {
    let phases = [
        Phase::Quarantined,
        Phase::Draining,
        Phase::Remediating,
        Phase::Verifying,
    ];
    let mut s = Scenario::new("crash", phases.len(), Scenario::quick_spec())
        .await
        .expect("scenario");
    s.start_agent();
    for (i, phase) in phases.into_iter().enumerate() {
        let node = s.nodes[i].clone();
        let lease = format!("{}-{i}", s.group);
        // The first replica records entry into `phase`, then dies before
        // carrying out a single action of it.
        let mut first = operator::start_with(
            &format!("{lease}-crashes"),
            Options {
                lease: Some(lease.clone()),
                crash_after: Some(format!("{phase:?}:{node}")),
                ..Default::default()
            },
        )
        .await
        .expect("operator");
        s.wait_taken_in().await.expect("taken in");
        let pods_before = s.pods_on(&node).await.expect("pods");
        s.break_gpu(&node, 7).await.expect("break");
        let exit = first.exited(WAIT).await.expect("the crash");
        assert_eq!(exit.code(), Some(3), "crashed through the test hook");
        let at_crash = s
            .wait_status(&node, "the recorded intent", |_| true)
            .await
            .expect("status");
        assert_eq!(at_crash.phase, phase, "crashed in {phase:?}");

        // Its successor waits out the dead leader's Lease, then finishes.
        let mut second = operator::start_with(
            &format!("{lease}-resumes"),
            Options {
                lease: Some(lease),
                ..Default::default()
            },
        )
        .await
        .expect("operator");
        let status = s.wait_recovered(&node).await.expect("recovers");
        assert!(
            !is_cordoned(&s.node(&node).await.expect("node")),
            "uncordoned"
        );
        second.kill().await;

        let written = s.agent.requests_written(&node);
        assert_eq!(
            written.len(),
            1,
            "one request written on {node}: {written:?}"
        );
        let request = ResetRequest::parse(&written[0]).expect("a reset request");
        assert!(request.id.to_string().ends_with("-reset-1"), "{request:?}");
        assert_eq!(
            status.history[0].attempts,
            [Attempt::new(
                RecoveryAction::GpuReset,
                1,
                AttemptOutcome::Succeeded
            )],
            "after a crash in {phase:?}"
        );
        let pods_after = s.pods_on(&node).await.expect("pods");
        for other in &pods_before[..7] {
            assert!(pods_after.contains(other), "{other} kept running");
        }
        eprintln!("crash in {phase:?}: resumed and recovered");
    }
}

#[tokio::test]
async fn only_the_lease_holder_acts_and_a_standby_takes_over() {
    let mut s = Scenario::new("leader", 2, Scenario::quick_spec())
        .await
        .expect("scenario");
    s.start_agent();
    let lease = format!("{}-lease", s.group);
    let options = Options {
        lease: Some(lease.clone()),
        ..Default::default()
    };
    let a_name = format!("{}-a", s.group);
    let b_name = format!("{}-b", s.group);
    let mut a = operator::start_with(&a_name, options.clone())
        .await
        .expect("replica a");
    lease_held_by(&s, &lease, &a_name, WAIT).await;
    let b = operator::start_with(&b_name, options)
        .await
        .expect("replica b");
    s.wait_taken_in().await.expect("taken in");
    // B is up and serving metrics, yet stands by.
    let metrics = b.scrape().await.expect("b's metrics");
    assert!(metrics.contains("gpuhealth_leader 0"), "{metrics}");

    let first = s.nodes[0].clone();
    s.break_gpu(&first, 7).await.expect("break");
    s.wait_recovered(&first).await.expect("recovers under a");
    // Its work ends when the evicted workload is judged back.
    s.wait_workloads_judged(&first)
        .await
        .expect("judged under a");
    assert_eq!(event_reporters(&s, &first).await, vec![a_name.clone()]);

    // A crash of the leader: B takes over once the Lease runs out.
    let killed = Instant::now();
    a.kill().await;
    lease_held_by(&s, &lease, &b_name, WAIT).await;
    let handover = killed.elapsed();
    eprintln!("leader killed; the standby took over after {handover:?}");
    assert!(
        handover <= LEASE_DURATION + 2 * RETRY_PERIOD,
        "handover took {handover:?}, lease duration {LEASE_DURATION:?}"
    );

    let second = s.nodes[1].clone();
    s.break_gpu(&second, 7).await.expect("break");
    s.wait_recovered(&second).await.expect("recovers under b");
    assert_eq!(event_reporters(&s, &second).await, vec![b_name]);
    assert_eq!(
        event_reporters(&s, &first).await,
        vec![a_name],
        "b did nothing on the node a finished"
    );
}

/// An API server slow to answer, within the renew deadline, does not cost
/// the leader its Lease: a renewal (a read and a write) may take until the
/// deadline, not one retry period. At 2,000 nodes the benchmark's leader
/// exited after its renewals, each cut at the retry period, timed out.
#[tokio::test]
async fn a_slow_api_server_does_not_cost_the_leader_its_lease() {
    // The operator's own timings: a 15 s lease, a 10 s renew deadline,
    // a renewal every 2 s.
    const LEASE: Duration = Duration::from_secs(15);
    let s = Scenario::new("slow-api", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    // Each answer 1.2 s late: a renewal's two take 2.4 s or more, past the
    // retry period, well within the renew deadline.
    let api = cluster::api_server_addr().await.expect("API server");
    let proxy = Proxy::slow(api, Duration::from_millis(1200))
        .await
        .expect("proxy");
    let kubeconfig = std::env::temp_dir().join(format!("{}-slow.kubeconfig", s.group));
    cluster::kubeconfig_via(proxy.addr, &kubeconfig)
        .await
        .expect("kubeconfig");
    let name = format!("{}-op", s.group);
    let options = Options {
        kubeconfig: Some(kubeconfig),
        default_lease_timings: true,
        ..Default::default()
    };
    let mut op = operator::start_with(&name, options)
        .await
        .expect("operator");
    lease_held_by(&s, &name, &name, WAIT).await;
    // Three leases' worth of renewals, each answered late; meanwhile it
    // takes the node in, as only the leader does.
    tokio::time::sleep(LEASE * 3).await;
    assert!(!op.has_exited(), "the leader exited: {}", op.log_text());
    s.wait_taken_in()
        .await
        .expect("taken in by the slow leader");
    lease_held_by(&s, &name, &name, WAIT).await;
    assert!(!op.has_exited(), "the leader exited: {}", op.log_text());
}

#[tokio::test]
async fn of_two_overlapping_policies_the_loser_shows_a_conflict() {
    let mut s = Scenario::new("overlap", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    s.start().await.expect("start");
    let policies: Api<GpuHealthPolicy> = Api::all(s.client.clone());
    let loser = second_policy(&s, "loser", |_| {}).await;
    let lost = until(policies.clone(), &loser, WAIT, |p| {
        condition(p, "Conflict").is_some_and(|c| c.status == "True")
    })
    .await
    .expect("the loser's Conflict condition");
    let message = condition(&lost, "Conflict").expect("condition").message;
    assert!(message.contains(&format!("1 by {}", s.policy)), "{message}");
    assert_eq!(lost.status.as_ref().map(|st| st.nodes), Some(0));
    let won = until(policies.clone(), &s.policy, WAIT, |p| {
        condition(p, "Conflict").is_some_and(|c| c.status == "False")
            && condition(p, "Ready").is_some_and(|c| c.status == "True")
    })
    .await
    .expect("the winner's conditions");
    assert_eq!(won.status.as_ref().map(|st| st.nodes), Some(1));
    s.wait_event(&loser, "Conflict").await.expect("an Event");

    // The node stays the winner's.
    let node = s.nodes[0].clone();
    s.break_gpu(&node, 7).await.expect("break");
    let status = s.wait_recovered(&node).await.expect("recovers");
    assert_eq!(status.policy.as_deref(), Some(s.policy.as_str()));
    policies
        .delete(&loser, &Default::default())
        .await
        .expect("clean up");
}

/// A policy's status follows the nodes' labels alone: a node relabelled
/// into a second policy's selection, with nothing else about it changed,
/// shows that policy the conflict, and relabelled out, clears it.
#[tokio::test]
async fn a_node_relabelled_into_a_second_policy_shows_it_the_conflict() {
    const POOL: &str = "gpuhealth-e2e/pool";
    let mut s = Scenario::new("relabel", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    s.start().await.expect("start");
    let policies: Api<GpuHealthPolicy> = Api::all(s.client.clone());
    let second = second_policy(&s, "pool-b", |spec| {
        spec.node_selector
            .match_labels
            .get_or_insert_default()
            .insert(POOL.into(), "b".into());
    })
    .await;
    let conflict = |p: &GpuHealthPolicy| condition(p, "Conflict");
    until(policies.clone(), &second, WAIT, |p| {
        ready(p).is_some_and(|c| c.status == "True")
            && conflict(p).is_none_or(|c| c.status == "False")
    })
    .await
    .expect("the second policy Ready, selecting no node");

    let nodes: Api<k8s_openapi::api::core::v1::Node> = Api::all(s.client.clone());
    let label = |value: serde_json::Value| {
        let nodes = nodes.clone();
        let node = s.nodes[0].clone();
        async move {
            nodes
                .patch(
                    &node,
                    &PatchParams::default(),
                    &Patch::Merge(json!({"metadata": {"labels": {POOL: value}}})),
                )
                .await
                .expect("relabel the node")
        }
    };
    label(json!("b")).await;
    let lost = until(policies.clone(), &second, WAIT, |p| {
        conflict(p).is_some_and(|c| c.status == "True")
    })
    .await
    .expect("the conflict, from the relabel alone");
    let message = conflict(&lost).expect("condition").message;
    assert!(message.contains(&format!("1 by {}", s.policy)), "{message}");

    label(serde_json::Value::Null).await;
    until(policies.clone(), &second, WAIT, |p| {
        conflict(p).is_some_and(|c| c.status == "False")
    })
    .await
    .expect("the conflict cleared, from the relabel alone");
    policies
        .delete(&second, &Default::default())
        .await
        .expect("clean up");
}

/// A second policy named `{scenario's}-{suffix}`: the scenario's spec at
/// priority 0, changed by `change`, so that it loses any node both select.
async fn second_policy(
    s: &Scenario,
    suffix: &str,
    change: impl FnOnce(&mut gpuhealth_api::GpuHealthPolicySpec),
) -> String {
    let policies: Api<GpuHealthPolicy> = Api::all(s.client.clone());
    let mut spec = policies
        .get(&s.policy)
        .await
        .expect("the scenario's policy")
        .spec;
    spec.priority = 0;
    change(&mut spec);
    let name = format!("{}-{suffix}", s.policy);
    policies
        .create(&PostParams::default(), &GpuHealthPolicy::new(&name, spec))
        .await
        .expect("a second policy");
    name
}

/// The policy's condition of `type_`, if it has one.
fn condition(p: &GpuHealthPolicy, type_: &str) -> Option<Condition> {
    p.status
        .as_ref()
        .and_then(|st| st.conditions.iter().find(|c| c.type_ == type_).cloned())
}

fn ready(p: &GpuHealthPolicy) -> Option<&Condition> {
    p.status
        .as_ref()
        .and_then(|st| st.conditions.iter().find(|c| c.type_ == "Ready"))
}

/// Waits until the policy's `Ready` is `status` with `reason`.
async fn ready_is(s: &Scenario, status: &str, reason: &str) -> Condition {
    let policies: Api<GpuHealthPolicy> = Api::all(s.client.clone());
    let p = until(policies, &s.policy, WAIT, |p| {
        ready(p).is_some_and(|c| c.status == status && c.reason == reason)
    })
    .await
    .unwrap_or_else(|e| panic!("Ready {status} {reason}: {e}"));
    ready(&p).cloned().expect("Ready")
}

/// gpuhealth's Events about the policy with `reason`: (type, message, how
/// many times it was seen).
async fn policy_events(s: &Scenario, reason: &str) -> Vec<(String, String, i32)> {
    let events: Api<Event> = Api::all(s.client.clone());
    let list = events
        .list(&ListParams::default().fields(&format!("involvedObject.name={}", s.policy)))
        .await
        .expect("events");
    list.items
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .map(|e| {
            let seen = e
                .series
                .as_ref()
                .and_then(|series| series.count)
                .or(e.count)
                .unwrap_or(1)
                .max(1);
            (
                e.type_.unwrap_or_default(),
                e.message.unwrap_or_default(),
                seen,
            )
        })
        .collect()
}

/// A maintenance window in a time zone nobody knows is accepted by the API
/// server (it cannot know), and used to make the policy silently never open
/// it. Now `Ready` is False, `CannotHonour`, naming the field, with one
/// Warning Event; fixing the zone makes it Ready again.
#[tokio::test]
async fn a_policy_with_an_unknown_time_zone_says_it_cannot_be_honoured() {
    let window = |zone: &str| MaintenanceWindow {
        days: Vec::new(),
        start: "22:00".into(),
        end: "06:00".into(),
        time_zone: zone.into(),
    };
    let mut spec = Scenario::quick_spec();
    spec.maintenance_windows = vec![window("Europe/Berlin"), window("Mars/Base")];
    let mut s = Scenario::new("honour-zone", 1, spec)
        .await
        .expect("scenario");
    s.start().await.expect("start");

    let field = "spec.maintenanceWindows[1].timeZone";
    let refused = ready_is(&s, "False", "CannotHonour").await;
    assert!(
        refused
            .message
            .starts_with(&format!("{field}: unknown time zone \"Mars/Base\"")),
        "{}",
        refused.message
    );
    s.wait_event_saying(&s.policy, "CannotHonour", field)
        .await
        .expect("a CannotHonour Event");
    let policies: Api<GpuHealthPolicy> = Api::all(s.client.clone());
    let managed = until(policies.clone(), &s.policy, WAIT, |p| {
        p.status.as_ref().is_some_and(|st| st.nodes == 1)
    })
    .await
    .expect("the rest of the policy still applies to its node");
    assert_eq!(
        ready(&managed).map(|c| c.reason.as_str()),
        Some("CannotHonour")
    );

    let mut fixed = managed.spec.maintenance_windows.clone();
    fixed[1].time_zone = "Asia/Tokyo".into();
    policies
        .patch(
            &s.policy,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"maintenanceWindows": fixed}})),
        )
        .await
        .expect("the zone fixed");
    let honoured = ready_is(&s, "True", "Managing").await;
    assert_eq!(honoured.message, "managing 1 node(s)");
    s.wait_event(&s.policy, "Honoured")
        .await
        .expect("an Honoured Event");
    // Once per change, not once per reconcile: one Warning, seen once.
    let warnings = policy_events(&s, "CannotHonour").await;
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    let (type_, message, seen) = &warnings[0];
    assert_eq!((type_.as_str(), *seen), ("Warning", 1), "{warnings:?}");
    assert!(message.starts_with(field), "{message}");
}

/// The cluster's guardrails bound a policy whatever it says. Selecting more
/// nodes than the fleet-wide bound, it enforces nothing until it says
/// acknowledgeFleetWide; then no more nodes are disrupted at once than the
/// cluster allows across policies, though the policy's own maxConcurrent
/// would allow all; an all-pods drain leaves a namespace the cluster never
/// drains; and a condition type the cluster does not allow is named.
#[tokio::test]
async fn the_clusters_guardrails_bound_every_policy() {
    let mut spec = Scenario::quick_spec();
    spec.drain.scope = DrainScope::AllPods;
    spec.max_concurrent = IntOrString::String("100%".into());
    spec.max_unhealthy = IntOrString::String("100%".into());
    let mut s = Scenario::new("guardrails", 3, spec)
        .await
        .expect("scenario");
    let (first, second) = (s.nodes[0].clone(), s.nodes[1].clone());
    let infra = format!("{}-infra", s.group);
    Api::<Namespace>::all(s.client.clone())
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": infra}})).expect("namespace"),
        )
        .await
        .expect("a namespace the cluster never drains");
    let pods: Api<Pod> = Api::namespaced(s.client.clone(), &infra);
    pods.create(
        &PostParams::default(),
        &serde_json::from_value(json!({
            "metadata": {"name": "node-exporter"},
            "spec": {"nodeName": first, "containers": [{"name": "c", "image": "exporter"}],
                     "tolerations": [{"operator": "Exists"}]},
        }))
        .expect("pod"),
    )
    .await
    .expect("a pod of the infra namespace on the first node");
    // The bound across policies counts every node of the cluster: the
    // nodes earlier tests of this file left (some mid-incident, their
    // operators gone) are removed, so that this test's are the fleet.
    let nodes: Api<Node> = Api::all(s.client.clone());
    for n in nodes
        .list(&ListParams::default())
        .await
        .expect("nodes")
        .items
    {
        let name = n.metadata.name.unwrap_or_default();
        if !s.nodes.contains(&name) {
            let _ = nodes.delete(&name, &Default::default()).await;
        }
    }
    s.operator_options.guardrails = Some(vec![
        "--fleet-wide-nodes=2".into(),
        "--max-disrupted-nodes=1".into(),
        format!("--never-drain-namespaces={infra}"),
    ]);
    // The first reset waits until the second node has been seen waiting.
    *s.agent.reset.lock().expect("answer") = Answer::Hold;
    s.start().await.expect("start");

    // Three nodes, more than two: nothing is enforced.
    let past = ready_is(&s, "False", Reason::PastGuardrail.as_str()).await;
    assert!(
        past.message.contains("spec.acknowledgeFleetWide")
            && past.message.contains("selects 3 nodes"),
        "{}",
        past.message
    );
    s.wait_event_saying(
        &s.policy,
        Reason::PastGuardrail.as_str(),
        "spec.acknowledgeFleetWide",
    )
    .await
    .expect("a PastGuardrail Event");
    assert_eq!(past_guardrails(&s).await, Some(1.0), "one bound past");
    s.break_gpu(&first, 7).await.expect("break");
    let held = s
        .wait_status(&first, "held past the guardrail", |st| {
            st.reason == Some(Reason::PastGuardrail)
        })
        .await
        .expect("held");
    assert_eq!(held.phase, Phase::Suspect);
    assert!(!is_cordoned(&s.node(&first).await.expect("node")));

    // Said: enforced, but one node disrupted at a time across policies.
    let policies: Api<GpuHealthPolicy> = Api::all(s.client.clone());
    policies
        .patch(
            &s.policy,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"acknowledgeFleetWide": true}})),
        )
        .await
        .expect("acknowledged");
    ready_is(&s, "True", "Managing").await;
    s.wait_event(&s.policy, "WithinGuardrails")
        .await
        .expect("a WithinGuardrails Event");
    assert_eq!(past_guardrails(&s).await, Some(0.0), "within every bound");
    s.wait_status(&first, "the first node's reset asked for", |st| {
        st.phase == Phase::Remediating
    })
    .await
    .expect("acted on");
    s.break_gpu(&second, 3).await.expect("break the second");
    let waiting = s
        .wait_status(&second, "the second waits for the cluster's bound", |st| {
            st.reason == Some(Reason::WaitingForBudget)
        })
        .await
        .expect("waiting");
    let message = waiting.message.unwrap_or_default();
    assert!(message.contains("--max-disrupted-nodes"), "{message}");
    s.agent
        .release(&s.client, &first)
        .await
        .expect("the first reset goes ahead");
    s.wait_recovered(&first).await.expect("the first recovered");
    s.wait_recovered(&second).await.expect("then the second");
    // The all-pods drain left the infra namespace's pod where it was.
    let kept = pods.get("node-exporter").await.expect("still there");
    assert!(kept.metadata.deletion_timestamp.is_none(), "never evicted");

    // A condition type the cluster does not allow (none, by default).
    policies
        .patch(
            &s.policy,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"detection": {"nodeConditions": [{
                "type": "E2eDetectorSaysBad", "status": "True",
                "writers": [{"group": "system:masters"}]}]}}})),
        )
        .await
        .expect("a condition rule");
    let past = ready_is(&s, "False", Reason::PastGuardrail.as_str()).await;
    assert!(
        past.message
            .contains("spec.detection.nodeConditions[0].type")
            && past.message.contains("E2eDetectorSaysBad"),
        "{}",
        past.message
    );
    let _ = Api::<Namespace>::all(s.client.clone())
        .delete(&infra, &Default::default())
        .await;
}

/// `gpuhealth_policy_past_guardrails` for the scenario's policy, as the
/// operator serves it.
async fn past_guardrails(s: &Scenario) -> Option<f64> {
    let text = s
        .operator
        .as_ref()
        .expect("the operator")
        .scrape()
        .await
        .expect("/metrics");
    let series = format!(
        "gpuhealth_policy_past_guardrails{{policy=\"{}\"}} ",
        s.policy
    );
    text.lines()
        .find_map(|l| l.strip_prefix(&series))
        .and_then(|v| v.trim().parse().ok())
}

/// Every rule the shipped RBAC (config/rbac/operator.yaml) gives the
/// operator, from its ClusterRoles and its Role.
fn shipped_rules() -> Vec<PolicyRule> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/rbac/operator.yaml");
    let text = std::fs::read_to_string(path).expect("config/rbac/operator.yaml");
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| serde_yaml::Value::deserialize(doc).expect("YAML"))
        .filter(|doc| {
            doc.get("kind")
                .and_then(serde_yaml::Value::as_str)
                .is_some_and(|k| k == "ClusterRole" || k == "Role")
        })
        .flat_map(|doc| {
            let rules = doc.get("rules").cloned().unwrap_or_default();
            serde_yaml::from_value::<Vec<PolicyRule>>(rules).expect("rules")
        })
        .collect()
}

/// kured's DaemonSet under another name: the shipped RBAC lets the operator
/// read only DaemonSets named `kured`, so the lock cannot be read, and
/// `Ready` says which field points at it. Granting the read makes it Ready
/// again, without a change to the policy.
#[tokio::test]
async fn a_lock_the_operator_may_not_read_is_named_in_ready() {
    let mut spec = Scenario::quick_spec();
    let kured = spec
        .other_actors
        .iter()
        .position(|a| a.source == SignalSource::KuredLock)
        .expect("kured's lock is a default actor");
    spec.other_actors[kured].object = Some("kube-system/kured-gpu".into());
    let mut s = Scenario::new("honour-lock", 1, spec)
        .await
        .expect("scenario");
    // The operator runs with exactly the rights the install gives it.
    let account = format!("{}-operator", s.group);
    let rules = shipped_rules();
    identities::account_with(&s.client, &s.namespace, &account, rules.clone())
        .await
        .expect("the operator's rights");
    let token = identities::token(&s.client, &s.namespace, &account, None)
        .await
        .expect("a token");
    let kubeconfig = std::env::temp_dir().join(format!("{account}.kubeconfig"));
    let kubeconfig = kubeconfig_with_token(&token, &kubeconfig)
        .await
        .expect("kubeconfig");
    s.operator_options = Options {
        kubeconfig: Some(kubeconfig),
        namespace: Some(s.namespace.clone()),
        ..Default::default()
    };
    s.start().await.expect("start");

    let field = format!("spec.otherActors[{kured}].object");
    let refused = ready_is(&s, "False", "CannotHonour").await;
    assert!(
        refused.message.starts_with(&format!(
            "{field}: kured's lock on DaemonSet kube-system/kured-gpu cannot be read (403 Forbidden: "
        )),
        "{}",
        refused.message
    );
    s.wait_event_saying(&s.policy, "CannotHonour", &field)
        .await
        .expect("a CannotHonour Event");

    // The read granted: the next polls succeed and Ready follows.
    let mut granted = rules;
    granted.push(PolicyRule {
        resource_names: Some(vec!["kured-gpu".into()]),
        ..identities::rule("apps", &["daemonsets"], &["get"])
    });
    identities::account_with(&s.client, &s.namespace, &account, granted)
        .await
        .expect("the read granted");
    let honoured = ready_is(&s, "True", "Managing").await;
    assert_eq!(honoured.message, "managing 1 node(s)");

    if let Some(mut operator) = s.operator.take() {
        operator.kill().await;
    }
    let _ = Api::<ClusterRoleBinding>::all(s.client.clone())
        .delete(&account, &Default::default())
        .await;
    let _ = Api::<ClusterRole>::all(s.client.clone())
        .delete(&account, &Default::default())
        .await;
}
