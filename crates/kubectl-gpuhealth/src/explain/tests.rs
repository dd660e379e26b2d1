use gpuhealth_api::{
    GpuNodeHealth,
    contract::{AnnotationValue, GpuReport},
    gang::{GangKey, GangMode, GangRecord, GangSource},
    vocabulary::{FindingKind, IncidentOutcome, Reason},
};
use k8s_openapi::{
    api::{core::v1::ObjectReference, events::v1::EventSeries},
    apimachinery::pkg::apis::meta::v1::MicroTime,
};

use super::*;

const FIXTURES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/explain-incident"
);
const GOLDEN: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/golden/explain-incident.txt"
);

fn t(s: &str) -> Timestamp {
    s.parse().expect("timestamp")
}

fn fixture(file: &str) -> String {
    std::fs::read_to_string(format!("{FIXTURES}/{file}")).expect("fixture file")
}

/// The incident, half an hour after the node recovered: GPU 7 of 8 had
/// Xid 119 then Xid 154, was quarantined, drained, reset once, verified and
/// uncordoned; its vLLM never came back, killed by a startup probe shorter
/// than its cold start.
fn incident() -> ExplainInput {
    let gnh: GpuNodeHealth = serde_json::from_str(&fixture("gpunodehealth.json")).expect("gnh");
    let events: Vec<CoreEvent> = serde_json::from_str(&fixture("events.json")).expect("events");
    ExplainInput {
        node: "192.168.1.1".into(),
        status: gnh.status.expect("status"),
        report: GpuReport::parse(&fixture("gpu-report.json")).map_err(|e| e.to_string()),
        events: events.iter().filter_map(NodeEvent::from_core).collect(),
        node_object: None,
        xid_overrides: Vec::new(),
    }
}

const ENDED: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/explain-ended-incident"
);
const ENDED_GOLDEN: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/golden/explain-ended-incident.txt"
);

/// The same incident as written by this release, read after the agent's
/// report has forgotten the Xids (GPU 7 is well again), with an Event left
/// by an earlier Node object of the same name.
fn ended_incident() -> ExplainInput {
    let read = |file: &str| std::fs::read_to_string(format!("{ENDED}/{file}")).expect(file);
    let gnh: GpuNodeHealth = serde_json::from_str(&read("gpunodehealth.json")).expect("gnh");
    let events: Vec<CoreEvent> = serde_json::from_str(&read("events.json")).expect("events");
    let node: k8s_openapi::api::core::v1::Node =
        serde_json::from_str(&read("node.json")).expect("node");
    ExplainInput {
        node: "192.168.1.1".into(),
        status: gnh.status.expect("status"),
        report: GpuReport::parse(&read("gpu-report.json")).map_err(|e| e.to_string()),
        events: events.iter().filter_map(NodeEvent::from_core).collect(),
        node_object: Some((
            node.metadata.uid.clone().expect("uid"),
            node.metadata.creation_timestamp.map(|t| t.0),
        )),
        xid_overrides: Vec::new(),
    }
}

const NOW: &str = "2026-05-29T09:00:00Z";

/// The rendered incident must match `tests/golden/explain-incident.txt`
/// byte for byte. After an intended change to the output, regenerate it
/// with `UPDATE_GOLDEN=1 cargo test -p kubectl-gpuhealth` and review the
/// diff before committing it.
#[test]
fn the_incident_reads_as_the_golden_file() {
    let rendered = render(&incident(), t(NOW), Style::default());
    if std::env::var_os("UPDATE_GOLDEN").is_some_and(|v| v == "1") {
        std::fs::write(GOLDEN, &rendered).expect("write the golden file");
        return;
    }
    let golden = std::fs::read_to_string(GOLDEN).expect("golden file (UPDATE_GOLDEN=1 writes it)");
    assert!(
        rendered == golden,
        "explain output differs from {GOLDEN}; if the change is intended, rerun with UPDATE_GOLDEN=1.\n--- rendered ---\n{rendered}"
    );
}

/// `tests/golden/explain-ended-incident.txt`, byte for byte (regenerated
/// like the first golden file).
#[test]
fn an_ended_incident_is_told_whole_from_its_record() {
    let input = ended_incident();
    assert!(
        input
            .report
            .as_ref()
            .is_ok_and(|r| r.gpus.iter().all(|g| g.xids.is_empty())),
        "the report no longer shows an Xid"
    );
    let rendered = render(&input, t(NOW), Style::default());
    if std::env::var_os("UPDATE_GOLDEN").is_some_and(|v| v == "1") {
        std::fs::write(ENDED_GOLDEN, &rendered).expect("write the golden file");
        return;
    }
    let golden = std::fs::read_to_string(ENDED_GOLDEN).expect("golden file");
    assert!(
        rendered == golden,
        "explain output differs from {ENDED_GOLDEN}; if the change is intended, rerun with UPDATE_GOLDEN=1.\n--- rendered ---\n{rendered}"
    );
    // What the golden file must hold, said here too.
    assert!(rendered.contains("Xid 119 on GPU 7"), "{rendered}");
    assert!(rendered.contains("Xid 154 on GPU 7"), "{rendered}");
    assert!(!rendered.contains("an earlier Node object"), "{rendered}");
    // The same story read without knowing the Node object keeps that Event:
    // the filter, not the fixture, leaves it out.
    let unfiltered = render(
        &ExplainInput {
            node_object: None,
            ..ended_incident()
        },
        t(NOW),
        Style::default(),
    );
    assert!(
        unfiltered.contains("an earlier Node object"),
        "{unfiltered}"
    );
}

#[test]
fn the_story_starts_at_the_first_signal_and_tells_each_thing_once() {
    let (origin, entries) = timeline(&incident());
    assert_eq!(origin, Some(t("2026-05-29T08:15:40Z")));
    let first = &entries[0];
    assert_eq!((first.kind, first.offset.as_str()), (Kind::Signal, "+0s"));
    assert!(first.text.contains("Xid 119 on GPU 7"), "{}", first.text);
    assert!(
        first.text.contains("asks for a GPU reset"),
        "{}",
        first.text
    );
    assert!(
        entries[1]
            .text
            .contains("recovery action 0x1: asks for a GPU reset"),
        "{}",
        entries[1].text
    );
    assert!(
        entries.windows(2).all(|w| w[0].at.0 <= w[1].at.0),
        "time order"
    );
    // The WorkloadNotRecovered Warning Event, its finding and the
    // incident's workload verdict are one thing.
    let told = entries
        .iter()
        .filter(|e| e.text.contains("WorkloadNotRecovered"))
        .count();
    assert_eq!(told, 1);
    let kubelet = entries
        .iter()
        .find(|e| e.text.starts_with("NodeNotSchedulable"))
        .expect("the kubelet's Event");
    assert!(kubelet.text.contains("[kubelet]"), "{}", kubelet.text);
}

#[test]
fn the_advice_points_at_the_probe_not_the_node() {
    let steps = next::steps(&incident(), t(NOW));
    assert_eq!(
        steps[0],
        "192.168.1.1 itself is Healthy: nothing to do for its GPUs"
    );
    assert_eq!(steps.len(), 2, "one workload, told once: {steps:#?}");
    assert!(
        steps[1].starts_with(
            "ReplicaSet/ml-serving/vllm-7d9f6: its startup probe gives up before it has started; `kubectl gpuhealth probe-check -n ml-serving deploy/vllm`"
        ),
        "{}",
        steps[1]
    );
}

#[test]
fn json_is_the_timeline_and_the_status() {
    let input = incident();
    let v = serde_json::to_value(explanation(&input, t(NOW))).expect("json");
    assert_eq!(v["origin"], "2026-05-29T08:15:40Z");
    assert_eq!(v["timeline"][0]["kind"], "signal");
    assert_eq!(v["timeline"][0]["offset"], "+0s");
    assert_eq!(v["timeline"][0]["at"], "2026-05-29T08:15:40Z");
    assert_eq!(v["status"]["history"][0]["id"], "inc-1780042543");
    assert!(v.get("reportError").is_none());
    assert!(
        v["timeline"][0].get("paint").is_none(),
        "colour is text only"
    );
}

fn bare(phase: Phase, reason: Option<Reason>, message: &str) -> ExplainInput {
    ExplainInput {
        node: "n1".into(),
        status: GpuNodeHealthStatus {
            phase,
            policy: Some("gpu-default".into()),
            phase_since: Some(Time(t("2026-05-29T08:00:00Z"))),
            reason,
            message: Some(message.into()),
            ..Default::default()
        },
        report: Err("node n1 has no gpuhealth.io/gpus report".into()),
        events: Vec::new(),
        node_object: None,
        xid_overrides: Vec::new(),
    }
}

#[test]
fn a_failed_node_passes_on_its_advice_and_says_how_to_hand_it_back() {
    let input = bare(
        Phase::Failed,
        Some(Reason::EscalationExhausted),
        "every rung of the escalation ladder failed (GpuReset#1 Failed, NodeReboot#1 Failed); the node stays cordoned: inspect its GPUs (nvidia-smi, kernel log), repair or replace it, then uncordon",
    );
    let steps = next::steps(&input, t(NOW));
    assert!(
        steps[0].contains("inspect its GPUs (nvidia-smi"),
        "{steps:#?}"
    );
    assert!(steps[1].contains("`kubectl uncordon n1`"), "{steps:#?}");
    let out = render(&input, t(NOW), Style::default());
    assert!(out.contains("No GPU report: node n1 has no"), "{out}");
    assert!(
        out.contains("phase      Failed since 2026-05-29T08:00:00Z (for 1h0m)"),
        "{out}"
    );
    assert!(out.contains("  nothing recorded"), "{out}");
}

#[test]
fn without_an_xid_offsets_count_from_the_first_entry() {
    let mut input = incident();
    input.report = Err("node 192.168.1.1 has no gpuhealth.io/gpus report".into());
    let (origin, entries) = timeline(&input);
    assert_eq!(origin, Some(t("2026-05-29T08:15:43Z")), "the incident");
    assert_eq!(entries[0].offset, "+0s");
    let out = render(&input, t(NOW), Style::default());
    assert!(
        out.contains("Timeline (offsets from the first entry, 2026-05-29T08:15:43Z)"),
        "{out}"
    );
}

#[test]
fn a_healthy_node_with_nothing_open_needs_nothing_and_old_findings_stay_old() {
    let mut input = bare(Phase::Healthy, None, "");
    assert_eq!(
        next::steps(&input, t(NOW)),
        vec!["nothing to do: n1 is Healthy and nothing is open"]
    );
    // A finding from before the latest incident was answered by it.
    input.status.findings.push(Finding {
        type_: FindingKind::StartupProbeTooShort,
        subject: Some("StatefulSet/ml/trainer".into()),
        message: "old".into(),
        observed_at: Time(t("2026-05-29T07:00:00Z")),
    });
    let mut old = incident().status.history[0].clone();
    old.workloads = None;
    input.status.history.push(old);
    assert_eq!(
        next::steps(&input, t(NOW)),
        vec!["nothing to do: n1 is Healthy and nothing is open"]
    );
}

#[test]
fn a_held_or_working_node_says_why_it_waits() {
    let held = bare(
        Phase::Suspect,
        Some(Reason::CircuitOpen),
        "3 of 10 nodes unhealthy; waiting to act on: Xid 79",
    );
    assert!(next::steps(&held, t(NOW))[0].contains("gpuhealth is holding back (CircuitOpen)"));
    let draining = bare(
        Phase::Draining,
        Some(Reason::WaitingForPod),
        "waiting for pod ml/db-0 to leave: PodDisruptionBudget allows 0",
    );
    assert!(next::steps(&draining, t(NOW))[0].starts_with("the drain is waiting"));
    let working = bare(
        Phase::Remediating,
        Some(Reason::ActionRequested),
        "GpuReset attempt 1 requested",
    );
    assert!(next::steps(&working, t(NOW))[0].starts_with("nothing to do yet"));
}

#[test]
fn events_k8s_io_events_read_like_core_ones() {
    let e = EventsV1Event {
        event_time: Some(MicroTime(t("2026-05-29T08:15:43.215Z"))),
        reason: Some(IncidentOutcome::Recovered.as_str().into()),
        note: Some("incident inc-1 recovered".into()),
        regarding: Some(ObjectReference {
            kind: Some("Node".into()),
            name: Some("n1".into()),
            ..Default::default()
        }),
        reporting_controller: Some(OPERATOR.into()),
        series: Some(EventSeries {
            count: 3,
            last_observed_time: MicroTime(t("2026-05-29T08:20:00Z")),
        }),
        type_: Some("Normal".into()),
        ..Default::default()
    };
    assert_eq!(
        NodeEvent::from_events_v1(&e),
        Some(NodeEvent {
            at: t("2026-05-29T08:15:43.215Z"),
            type_: "Normal".into(),
            reason: IncidentOutcome::Recovered.as_str().into(),
            message: "incident inc-1 recovered".into(),
            reporter: OPERATOR.into(),
            count: 3,
            uid: String::new(),
        })
    );
}

fn gang(name: &str, mode: GangMode, members: u32, nodes: usize) -> GangRecord {
    GangRecord {
        gang: GangKey {
            source: GangSource::JobSet,
            namespace: "ml".into(),
            name: name.into(),
        },
        mode,
        members,
        nodes: (0..nodes).map(|n| format!("192.168.1.{}", n + 1)).collect(),
        evict_at: None,
        evicted_at: None,
        restarted_on_its_own: false,
    }
}

/// The recorded incident, had its GPU been held by gangs: one told and
/// evicted together, one restarting on its own, one under each other mode.
#[test]
fn an_incident_tells_how_each_gang_left() {
    let mut input = incident();
    let mut whole = gang("train", GangMode::Whole, 32, 4);
    whole.evict_at = Some(Time(t("2026-05-29T08:15:45Z")));
    whole.evicted_at = Some(Time(t("2026-05-29T08:16:46Z")));
    let mut on_its_own = gang("sweep", GangMode::Whole, 2, 1);
    on_its_own.restarted_on_its_own = true;
    let mut no_notice = gang("bench", GangMode::Whole, 1, 1);
    no_notice.evict_at = Some(Time(t("2026-05-29T08:15:50Z")));
    no_notice.evicted_at = no_notice.evict_at.clone();
    input.status.history[0].gangs = vec![
        whole,
        on_its_own,
        no_notice,
        gang("serve", GangMode::Member, 4, 2),
        gang("etl", GangMode::Never, 8, 1),
        gang("eval", GangMode::Whole, 0, 0),
    ];
    let out = render(&input, t(NOW), Style::default());
    let block = [
        "  gangs      JobSet ml/train (Whole): 32 members on 4 nodes; told they leave together at 2026-05-29T08:15:45Z  +5s; evicted together at 2026-05-29T08:16:46Z  +1m6s",
        "             JobSet ml/sweep (Whole): 2 members on 1 node; restarting on its own: not evicted twice",
        "             JobSet ml/bench (Whole): 1 member on 1 node; evicted together at 2026-05-29T08:15:50Z  +10s",
        "             JobSet ml/serve (Member): 4 members on 2 nodes; only the holder moves, evicted as any pod; the gang's controller decides the rest",
        "             JobSet ml/etl (Never): 8 members on 1 node; gpuhealth evicts none of it: the gang's controller or a person moves its members",
        "             JobSet ml/eval (Whole): members not counted yet; not evicted by this incident",
    ]
    .join("\n");
    assert!(out.contains(&block), "missing\n{block}\nin:\n{out}");
    // Once the incident has ended, nothing waits on them.
    let steps = next::steps(&input, t(NOW));
    assert!(!steps.iter().any(|s| s.contains("JobSet")), "{steps:#?}");
}

/// Mid-drain, a gang told it leaves at 08:16:45 (in 45s at 08:16:00).
fn draining_with_a_told_gang() -> ExplainInput {
    let mut input = bare(
        Phase::Draining,
        Some(Reason::Draining),
        "0 to evict, 0 to finish, 8 with their gang; JobSet ml/train: 32 members on 4 nodes told; they leave together at 2026-05-29T08:16:45Z",
    );
    let mut open = incident().status.history[0].clone();
    open.ended_at = None;
    open.outcome = None;
    open.workloads = None;
    open.attempts.clear();
    open.actions.clear();
    let mut whole = gang("train", GangMode::Whole, 32, 4);
    whole.evict_at = Some(Time(t("2026-05-29T08:16:45Z")));
    open.gangs = vec![whole, gang("etl", GangMode::Never, 8, 1)];
    input.status.history.push(open);
    input
}

#[test]
fn a_drain_waiting_on_a_gang_says_when_it_goes() {
    let input = draining_with_a_told_gang();
    let now = t("2026-05-29T08:16:00Z");
    let out = render(&input, now, Style::default());
    assert!(
        out.contains(
            "  gangs      JobSet ml/train (Whole): 32 members on 4 nodes; told they leave together at 2026-05-29T08:16:45Z  +1m2s (in 45s)\n"
        ),
        "{out}"
    );
    let steps = next::steps(&input, now);
    assert!(steps[0].starts_with("nothing to do yet"), "{steps:#?}");
    assert_eq!(
        steps[1],
        "wait: JobSet ml/train leaves together at 2026-05-29T08:16:45Z (in 45s): its 32 members on 4 nodes are told (annotation gpuhealth.io/evict-at, condition gpuhealth.io/disruption-pending), time to checkpoint; then all are deleted at once"
    );
    assert_eq!(steps.len(), 2, "a Never gang holds no pod here: {steps:#?}");
    assert!(out.contains(&format!("  - {}\n", steps[1])), "{out}");

    // Past its time, a budget holds it.
    let late = t("2026-05-29T08:17:15Z");
    let out = render(&input, late, Style::default());
    assert!(out.contains("(due 30s ago); not evicted yet\n"), "{out}");
    assert!(
        next::steps(&input, late)[1].starts_with(
            "wait: JobSet ml/train was due to leave together at 2026-05-29T08:16:45Z (30s ago); all its members are deleted at once when every PodDisruptionBudget"
        ),
        "{:#?}",
        next::steps(&input, late)
    );
}

#[test]
fn a_gang_that_may_not_be_evicted_is_named_while_the_drain_waits_for_a_pod() {
    let mut input = draining_with_a_told_gang();
    input.status.reason = Some(Reason::WaitingForPod);
    input.status.history[0].gangs[0].restarted_on_its_own = true;
    let steps = next::steps(&input, t("2026-05-29T08:16:00Z"));
    assert!(steps[0].starts_with("the drain is waiting"), "{steps:#?}");
    assert_eq!(
        steps[1..],
        [
            "wait: JobSet ml/train is restarting on its own, so gpuhealth does not evict it twice; the drain goes on once its members on n1 have left",
            "JobSet ml/etl is never evicted by gpuhealth (drain.gangs.mode Never): while its members hold the drain, move them off n1 through the gang's controller, or delete them",
        ]
    );
}

#[test]
fn a_diagnostic_shows_each_test_under_its_attempt_and_what_to_wait_for() {
    use gpuhealth_api::{
        contract::{
            DiagnosticTest, DiagnosticsLevel, DiagnosticsResult, DiagnosticsVerdict, TestVerdict,
        },
        vocabulary::{AttemptAction, AttemptOutcome},
    };
    let mut input = bare(
        Phase::Verifying,
        Some(Reason::Diagnosing),
        "signals clear; waiting for the Quick DCGM diagnostic of GPU-0a1b2c3d (inc-1-reboot-1-diagnostics)",
    );
    let mut open = incident().status.history[0].clone();
    open.ended_at = None;
    open.outcome = None;
    open.workloads = None;
    open.actions.clear();
    let mut failed = Attempt::new(AttemptAction::Diagnostics, 1, AttemptOutcome::Failed)
        .saying("memory on GPU-0a1b2c3d: Fail (DBE pending)");
    failed.diagnostics = Some(DiagnosticsResult {
        level: DiagnosticsLevel::Medium,
        verdict: DiagnosticsVerdict::Fail,
        dcgm_version: Some("4.2.3".into()),
        tests: vec![
            DiagnosticTest {
                name: "software".into(),
                gpu: None,
                verdict: TestVerdict::Pass,
                detail: None,
            },
            DiagnosticTest {
                name: "memory".into(),
                gpu: Some("GPU-0a1b2c3d".into()),
                verdict: TestVerdict::Fail,
                detail: Some("DBE pending".into()),
            },
        ],
    });
    open.attempts = vec![
        Attempt::new(AttemptAction::GpuReset, 1, AttemptOutcome::Succeeded),
        failed,
    ];
    input.status.history.push(open);
    let now = t("2026-05-29T08:20:00Z");
    let out = render(&input, now, Style::default());
    for line in [
        "             2. Diagnostics#1 Failed: memory on GPU-0a1b2c3d: Fail (DBE pending)\n",
        "                Medium diagnostic, DCGM 4.2.3: Fail\n",
        "                  software               -                                        Pass\n",
        "                  memory                 GPU-0a1b2c3d                             Fail DBE pending\n",
    ] {
        assert!(out.contains(line), "{line:?} in:\n{out}");
    }
    let steps = next::steps(&input, now);
    assert!(
        steps[0].starts_with("wait: signals clear; waiting for the Quick DCGM diagnostic")
            && steps[0].contains("next rung"),
        "{steps:#?}"
    );
}
