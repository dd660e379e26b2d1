//! The operator process itself on the real API server: crashes at the worst
//! moments, two replicas behind one Lease, and overlapping policies.

use std::time::{Duration, Instant};

use gpuhealth_api::{
    GpuHealthPolicy, RecoveryAction,
    contract::{AnnotationValue, ResetRequest},
    node_health::Phase,
    vocabulary::{Attempt, AttemptOutcome},
};
use gpuhealth_e2e::{
    operator::{self, LEASE_DURATION, Options, RETRY_PERIOD},
    scenario::{Scenario, WAIT},
    sim::is_cordoned,
    wait::until,
};
use k8s_openapi::api::{coordination::v1::Lease, core::v1::Event};
use kube::{
    Api,
    api::{ListParams, PostParams},
};

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

#[tokio::test]
async fn of_two_overlapping_policies_the_loser_shows_a_conflict() {
    let mut s = Scenario::new("overlap", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    s.start().await.expect("start");
    let policies: Api<GpuHealthPolicy> = Api::all(s.client.clone());
    let winner = policies
        .get(&s.policy)
        .await
        .expect("the scenario's policy");
    let mut spec = winner.spec.clone();
    spec.priority = 0;
    let loser = format!("{}-loser", s.policy);
    policies
        .create(&PostParams::default(), &GpuHealthPolicy::new(&loser, spec))
        .await
        .expect("an overlapping policy");

    let condition = |p: &GpuHealthPolicy, type_: &str| {
        p.status
            .as_ref()
            .and_then(|st| st.conditions.iter().find(|c| c.type_ == type_).cloned())
    };
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
