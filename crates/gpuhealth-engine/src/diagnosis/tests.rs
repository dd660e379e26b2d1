use gpuhealth_api::{
    Duration,
    contract::{AnnotationValue, XidEvent},
    policy::{ConditionRule, ConditionWriter, GpuHealthPolicySpec},
    vocabulary::PodKey,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

use super::*;

pub(super) fn ts(s: &str) -> Timestamp {
    s.parse().expect("timestamp")
}

pub(super) fn incident_report() -> Result<GpuReport, ContractError> {
    GpuReport::parse(include_str!(
        "../../../gpuhealth-api/tests/fixtures/incident-gpu-report.json"
    ))
}

pub(super) fn detection() -> Detection {
    GpuHealthPolicySpec::for_selector(Default::default()).detection
}

#[test]
fn the_incident_needs_a_reset_of_gpu_7_only() {
    let report = incident_report();
    let evidence = Evidence {
        conditions: &[],
        report: Some(&report),
        report_refreshed_at: None,
        report_awaited_since: None,
        report_missing_before: false,
        xids_since: None,
        devices: &[],
        unhealthy: &[],
        gang_window: None,
    };
    let d = diagnose(ts("2026-05-29T08:25:00Z"), &detection(), &evidence);
    assert_eq!(d.required(), Some(RecoveryAction::GpuReset));
    assert_eq!(d.gpus(), ["GPU-0a1b2c3d-0000-4000-8000-000000000007"]);
    assert!(d.signals.iter().any(|s| s.message.contains("Xid 119")));
    assert!(d.signals.iter().any(|s| s.message.contains("Xid 154")));
}

#[test]
fn xids_before_the_last_action_are_history() {
    let mut report = incident_report().expect("valid");
    report.gpus[7].health = GpuHealth::Healthy;
    report.gpus[7].recovery_action = Some(0);
    let report = Ok(report);
    let evidence = Evidence {
        conditions: &[],
        report: Some(&report),
        report_refreshed_at: None,
        report_awaited_since: None,
        report_missing_before: false,
        xids_since: Some(ts("2026-05-29T09:00:00Z")),
        devices: &[],
        unhealthy: &[],
        gang_window: None,
    };
    let d = diagnose(ts("2026-05-29T09:10:00Z"), &detection(), &evidence);
    assert!(d.is_clear(), "{d:?}");
}

#[test]
fn xid_79_asks_for_a_reboot() {
    let mut report = incident_report().expect("valid");
    report.gpus[3].xids.push(XidEvent::new(
        79,
        Time(ts("2026-05-29T08:20:00Z")),
        "GPU has fallen off the bus.",
    ));
    let report = Ok(report);
    let d = diagnose(
        ts("2026-05-29T08:25:00Z"),
        &detection(),
        &Evidence {
            conditions: &[],
            report: Some(&report),
            report_refreshed_at: None,
            report_awaited_since: None,
            report_missing_before: false,
            xids_since: None,
            devices: &[],
            unhealthy: &[],
            gang_window: None,
        },
    );
    assert_eq!(d.required(), Some(RecoveryAction::NodeReboot));
    assert_eq!(d.headline().map(|s| s.reason), Some(Reason::Xid));
}

#[test]
fn unknown_xids_are_reported_not_acted_on() {
    let mut report = incident_report().expect("valid");
    report.gpus[7] = report.gpus[6].clone();
    report.gpus[7].index = 7;
    report.gpus[7].uuid = "GPU-0a1b2c3d-0000-4000-8000-000000000007".into();
    report.gpus[0]
        .xids
        .push(XidEvent::new(4242, Time(ts("2026-05-29T08:20:00Z")), ""));
    let report = Ok(report);
    let d = diagnose(
        ts("2026-05-29T08:25:00Z"),
        &detection(),
        &Evidence {
            conditions: &[],
            report: Some(&report),
            report_refreshed_at: None,
            report_awaited_since: None,
            report_missing_before: false,
            xids_since: None,
            devices: &[],
            unhealthy: &[],
            gang_window: None,
        },
    );
    assert!(d.signals.is_empty(), "{d:?}");
    assert_eq!(d.unknown_xids, [4242]);
}

#[test]
fn conditions_wait_for_their_for_duration() {
    let mut det = detection();
    let rule = ConditionRule {
        type_: "SysLogsXIDError".into(),
        status: ConditionStatus::True,
        for_: Duration::from_secs(60),
        action: SignalAction::NodeReboot,
        writers: vec![ConditionWriter::service_account(
            "npd",
            "node-problem-detector",
        )],
    };
    det.node_conditions.push(rule.clone());
    let conditions = [ObservedCondition {
        type_: "SysLogsXIDError".into(),
        status: "True".into(),
        last_transition: ts("2026-05-29T08:00:00Z"),
    }];
    let ev = Evidence {
        conditions: &conditions,
        report: None,
        report_refreshed_at: None,
        report_awaited_since: None,
        report_missing_before: false,
        xids_since: None,
        devices: &[],
        unhealthy: &[],
        gang_window: None,
    };
    let early = diagnose(ts("2026-05-29T08:00:30Z"), &det, &ev);
    assert_eq!(early.required(), None);
    assert_eq!(early.pending_until, Some(ts("2026-05-29T08:01:00Z")));
    let late = diagnose(ts("2026-05-29T08:01:00Z"), &det, &ev);
    assert_eq!(late.required(), Some(RecoveryAction::NodeReboot));
    assert!(late.gpus().is_empty(), "a condition names no GPU");

    // A rule that names no writer is not acted on: anyone who may patch
    // the Node's status could have written the condition.
    det.node_conditions = vec![ConditionRule {
        writers: Vec::new(),
        ..rule
    }];
    let unwritten = diagnose(ts("2026-05-29T08:01:00Z"), &det, &ev);
    assert_eq!(unwritten.required(), None, "{unwritten:?}");
}

#[test]
fn a_malformed_report_is_an_error_not_a_signal() {
    let report = GpuReport::parse("{not json");
    let d = diagnose(
        ts("2026-05-29T08:25:00Z"),
        &detection(),
        &Evidence {
            conditions: &[],
            report: Some(&report),
            report_refreshed_at: None,
            report_awaited_since: None,
            report_missing_before: false,
            xids_since: None,
            devices: &[],
            unhealthy: &[],
            gang_window: None,
        },
    );
    assert!(d.signals.is_empty());
    assert!(d.report_error.is_some());
}

#[test]
fn repeated_app_faults_escalate_to_a_reset_only_across_workloads() {
    let evidence = |report| Evidence {
        conditions: &[],
        report: Some(report),
        report_refreshed_at: None,
        report_awaited_since: None,
        report_missing_before: false,
        xids_since: None,
        devices: &[],
        unhealthy: &[],
        gang_window: None,
    };
    let fault = |code, minute: u32, pod: &str| XidEvent {
        pod: Some(gpuhealth_api::contract::PodRef {
            namespace: "tenant".into(),
            name: pod.into(),
            container: None,
        }),
        ..XidEvent::new(code, Time(ts(&format!("2026-05-29T08:0{minute}:00Z"))), "")
    };
    let mut report = incident_report().expect("valid");
    report.gpus[7] = report.gpus[6].clone();
    report.gpus[7].index = 7;
    report.gpus[7].uuid = "GPU-0a1b2c3d-0000-4000-8000-000000000007".into();
    report.gpus[2].xids = vec![fault(13, 1, "a"), fault(13, 2, "a")];
    let now = ts("2026-05-29T08:30:00Z");
    let two = Ok(report.clone());
    let d = diagnose(now, &detection(), &evidence(&two));
    assert!(
        d.signals.is_empty() && d.app_fault_loops.is_empty(),
        "{d:?}"
    );

    // A third from the same pod: the pod's problem, not the GPU's.
    report.gpus[2].xids.push(fault(31, 3, "a"));
    let looping = Ok(report.clone());
    let d = diagnose(now, &detection(), &evidence(&looping));
    assert!(d.signals.is_empty(), "{d:?}");
    assert_eq!(d.app_fault_loops.len(), 1);
    assert_eq!(d.app_fault_loops[0].pod, PodKey::new("tenant", "a"));

    // From a second workload too: the GPU is reset.
    report.gpus[2].xids[2] = fault(31, 3, "b");
    let across = Ok(report);
    let d = diagnose(now, &detection(), &evidence(&across));
    assert_eq!(d.required(), Some(RecoveryAction::GpuReset));
    assert_eq!(
        d.headline().map(|s| s.reason),
        Some(Reason::RepeatedAppXids)
    );
}

#[test]
fn an_xid_nvml_did_not_confirm_is_said_never_acted_on() {
    let mut report = incident_report().expect("valid");
    report.gpus[7] = report.gpus[6].clone();
    report.gpus[7].index = 7;
    report.gpus[7].uuid = "GPU-0a1b2c3d-0000-4000-8000-000000000007".into();
    report.gpus[3].xids.push(XidEvent {
        uncorroborated: true,
        ..XidEvent::new(
            79,
            Time(ts("2026-05-29T08:20:00Z")),
            "GPU has fallen off the bus.",
        )
    });
    let report = Ok(report);
    let d = diagnose(
        ts("2026-05-29T08:25:00Z"),
        &detection(),
        &Evidence {
            conditions: &[],
            report: Some(&report),
            report_refreshed_at: None,
            report_awaited_since: None,
            report_missing_before: false,
            xids_since: None,
            devices: &[],
            unhealthy: &[],
            gang_window: None,
        },
    );
    assert!(d.signals.is_empty(), "{d:?}");
    assert_eq!(d.uncorroborated.len(), 1);
    assert_eq!(d.uncorroborated[0].1.code, 79);
}
