//! The node annotation contract: every value round-trips, and malformed or
//! hostile input is refused with a typed error that names the field,
//! never a panic.

use gpuhealth_api::{
    GpuHealth,
    contract::{
        AnnotationValue, ContractError, DisruptionTolerance, GpuReport, MAX_VALUE_BYTES,
        MaintenanceNotice, Outcome, RebootRequest, RequestId, RequestResult, ResetRequest,
    },
};
use serde_json::{Value, json};

const INCIDENT: &str = include_str!("fixtures/incident-gpu-report.json");

fn incident() -> Value {
    serde_json::from_str(INCIDENT).expect("fixture is JSON")
}

fn field_of(err: &ContractError) -> &str {
    match err {
        ContractError::Invalid { field, .. } => field,
        other => panic!("expected a field error, got {other}"),
    }
}

#[test]
fn the_incident_report_parses() {
    let report = GpuReport::parse(INCIDENT).expect("the incident's report is valid");
    assert_eq!(report.gpus.len(), 8);
    let bad: Vec<_> = report.bad_gpus().collect();
    assert_eq!(bad.len(), 1);
    assert_eq!(bad[0].index, 7);
    assert_eq!(bad[0].health, GpuHealth::ResetRequired);
    assert_eq!(bad[0].pci_bus_id, "00000000:E1:00.0");
    assert_eq!(
        bad[0].xids.iter().map(|x| x.code).collect::<Vec<_>>(),
        [119, 154]
    );
    assert_eq!(bad[0].recovery_action, Some(1));
    assert_eq!(bad[0].pods[0].name, "vllm-0");
}

#[test]
fn reports_round_trip() {
    let report = GpuReport::parse(INCIDENT).expect("valid");
    let again = GpuReport::parse(&report.to_annotation()).expect("own output parses");
    assert_eq!(report, again);
}

#[test]
fn unknown_fields_are_ignored_for_forward_compatibility() {
    let mut v = incident();
    v["gpus"][0]["temperatureC"] = json!(61);
    v["future"] = json!({"anything": true});
    assert!(GpuReport::parse(&v.to_string()).is_ok());
}

/// Each case mutates the valid incident report in one way; the error must
/// name the field.
#[test]
fn invalid_reports_name_the_field() {
    type Mutation = fn(&mut Value);
    let cases: Vec<(&str, Mutation)> = vec![
        ("gpus[0].uuid", |v| {
            v["gpus"][0]["uuid"] = json!("not-a-uuid")
        }),
        ("gpus[0].uuid", |v| v["gpus"][0]["uuid"] = json!("GPU-")),
        ("gpus[1].uuid", |v| {
            v["gpus"][1]["uuid"] = v["gpus"][0]["uuid"].clone()
        }),
        ("gpus[1].index", |v| v["gpus"][1]["index"] = json!(0)),
        ("gpus[0].pciBusId", |v| {
            v["gpus"][0]["pciBusId"] = json!("e1:00.0")
        }),
        ("gpus[0].pciBusId", |v| {
            v["gpus"][0]["pciBusId"] = json!("0000:e1:00.9")
        }),
        ("gpus[7].xids[0].text", |v| {
            v["gpus"][7]["xids"][0]["text"] = json!("x".repeat(600))
        }),
        ("gpus[7].xids", |v| {
            v["gpus"][7]["xids"] =
                json!(vec![json!({"code": 13, "at": "2026-05-29T08:15:40Z"}); 33])
        }),
        ("gpus[7].pods[0].namespace", |v| {
            v["gpus"][7]["pods"][0]["namespace"] = json!("ML_Serving")
        }),
        ("gpus[7].pods[0].name", |v| {
            v["gpus"][7]["pods"][0]["name"] = json!("../../etc/passwd")
        }),
        ("gpus[0].product", |v| {
            v["gpus"][0]["product"] = json!("p".repeat(200))
        }),
        ("source", |v| v["source"] = json!("s".repeat(200))),
        ("gpus", |v| {
            let gpu = v["gpus"][0].clone();
            let many: Vec<Value> = (0..65)
                .map(|i| {
                    let mut g = gpu.clone();
                    g["index"] = json!(i);
                    g["uuid"] = json!(format!("GPU-0a1b2c3d-0000-4000-8000-{i:012}"));
                    g
                })
                .collect();
            v["gpus"] = json!(many);
        }),
    ];
    for (field, mutate) in cases {
        let mut v = incident();
        mutate(&mut v);
        let err = GpuReport::parse(&v.to_string()).expect_err(field);
        assert_eq!(field_of(&err), field, "{err}");
        assert!(
            err.to_string().contains(field),
            "message names the field: {err}"
        );
    }
}

#[test]
fn malformed_reports_are_refused_without_panicking() {
    let cases = [
        "",
        "null",
        "[]",
        "{",
        "{\"version\": 1}",
        "not json at all",
        "{\"version\": 1, \"observedAt\": \"yesterday\", \"gpus\": []}",
        "{\"version\": 1, \"observedAt\": \"2026-05-29T08:24:54Z\", \"gpus\": [{\"index\": -1}]}",
        "{\"version\": 99999999999, \"observedAt\": \"2026-05-29T08:24:54Z\", \"gpus\": []}",
        "{\"version\": 1, \"observedAt\": \"2026-05-29T08:24:54Z\", \"gpus\": {\"0\": {}}}",
    ];
    for raw in cases {
        let err = GpuReport::parse(raw).expect_err(raw);
        assert_eq!(err.metric_label(), "malformed", "{raw}: {err}");
    }
    // An unknown health state is a malformed report, not a guess.
    let mut v = incident();
    v["gpus"][7]["health"] = json!("OnFire");
    assert_eq!(
        GpuReport::parse(&v.to_string())
            .expect_err("unknown state")
            .metric_label(),
        "malformed"
    );
}

#[test]
fn other_versions_are_refused_with_the_version() {
    let mut v = incident();
    v["version"] = json!(2);
    match GpuReport::parse(&v.to_string()) {
        Err(ContractError::UnsupportedVersion {
            found: 2,
            supported: 1,
            ..
        }) => {}
        other => panic!("expected UnsupportedVersion, got {other:?}"),
    }
}

#[test]
fn hostile_input_is_bounded() {
    // Larger than any value of ours may be.
    let huge = format!(
        "{{\"version\": 1, \"pad\": \"{}\"}}",
        "a".repeat(MAX_VALUE_BYTES)
    );
    assert_eq!(
        GpuReport::parse(&huge)
            .expect_err("too large")
            .metric_label(),
        "too_large"
    );
    // Nesting deeper than serde_json's recursion limit.
    let deep = format!("{}{}", "[".repeat(10_000), "]".repeat(10_000));
    assert_eq!(
        GpuReport::parse(&deep)
            .expect_err("too deep")
            .metric_label(),
        "malformed"
    );
    // Control characters and odd unicode in identifiers.
    let mut v = incident();
    v["gpus"][0]["uuid"] = json!("GPU-\u{0}\u{202e}abcdef12");
    let err = GpuReport::parse(&v.to_string()).expect_err("control characters");
    assert!(
        !err.to_string().contains('\u{0}'),
        "errors do not echo control characters"
    );
}

#[test]
fn requests_and_results_round_trip() {
    let reset = json!({"id": "inc-7-reset-1", "gpus": ["GPU-0a1b2c3d-0000-4000-8000-000000000007"],
                       "requestedAt": "2026-05-29T08:30:00Z"});
    let parsed = ResetRequest::parse(&reset.to_string()).expect("valid reset request");
    assert_eq!(parsed.id.as_str(), "inc-7-reset-1");
    assert_eq!(
        ResetRequest::parse(&parsed.to_annotation()).expect("round trip"),
        parsed
    );

    let reboot =
        RebootRequest::parse(r#"{"id":"inc-7-reboot-1","requestedAt":"2026-05-29T09:00:00Z"}"#)
            .expect("valid reboot request");
    assert_eq!(
        reboot.id,
        "inc-7-reboot-1".parse::<RequestId>().expect("id")
    );

    let result = RequestResult::parse(
        r#"{"id":"inc-7-reset-1","outcome":"Refused","message":"process 4242 holds the GPU","finishedAt":"2026-05-29T08:30:05Z"}"#,
    )
    .expect("valid result");
    assert_eq!(result.outcome, Outcome::Refused);
}

#[test]
fn invalid_requests_are_refused() {
    let no_gpus = r#"{"id":"r1","gpus":[],"requestedAt":"2026-05-29T08:30:00Z"}"#;
    assert_eq!(
        field_of(&ResetRequest::parse(no_gpus).expect_err("no gpus")),
        "gpus"
    );
    let by_index = r#"{"id":"r1","gpus":["7"],"requestedAt":"2026-05-29T08:30:00Z"}"#;
    assert_eq!(
        field_of(&ResetRequest::parse(by_index).expect_err("index, not uuid")),
        "gpus[0]"
    );
    for id in ["", "UPPER", "-lead", "has space", &"x".repeat(64)] {
        let raw = json!({"id": id, "requestedAt": "2026-05-29T09:00:00Z"}).to_string();
        assert_eq!(
            RebootRequest::parse(&raw).expect_err(id).metric_label(),
            "malformed",
            "{id:?}"
        );
    }
    let outcome = r#"{"id":"r1","outcome":"Maybe","finishedAt":"2026-05-29T08:30:05Z"}"#;
    assert!(RequestResult::parse(outcome).is_err());
}

#[test]
fn maintenance_notice_from_the_incident() {
    // The vendor's notice: maintenance on 2026-06-02 08:15:52 (+08:00).
    let raw = r#"{"deadline":"2026-06-02T00:15:52Z","source":"cloud-provider","reason":"hardware risk: may cause high load or outage","reference":"<INSTANCE_ID>"}"#;
    let notice = MaintenanceNotice::parse(raw).expect("valid notice");
    assert_eq!(notice.source, "cloud-provider");
    let blank = r#"{"deadline":"2026-06-02T00:15:52Z","source":" ","reason":"x"}"#;
    assert_eq!(
        field_of(&MaintenanceNotice::parse(blank).expect_err("blank source")),
        "source"
    );
    let no_deadline = r#"{"source":"ops","reason":"x"}"#;
    assert_eq!(
        MaintenanceNotice::parse(no_deadline)
            .expect_err("no deadline")
            .metric_label(),
        "malformed"
    );
}

#[test]
fn disruption_tolerance_values() {
    assert_eq!(
        DisruptionTolerance::from_annotation(None).expect("absent"),
        DisruptionTolerance::Evict
    );
    assert_eq!(
        DisruptionTolerance::from_annotation(Some("never")).expect("never"),
        DisruptionTolerance::Never
    );
    assert_eq!(
        DisruptionTolerance::from_annotation(Some("wait")).expect("wait"),
        DisruptionTolerance::Wait
    );
    let err = DisruptionTolerance::from_annotation(Some("sometimes")).expect_err("unknown");
    assert!(err.to_string().contains("evict, wait, never"), "{err}");
}

proptest::proptest! {
    #[test]
    fn arbitrary_text_never_panics(raw in "\\PC{0,300}") {
        let _ = GpuReport::parse(&raw);
        let _ = ResetRequest::parse(&raw);
        let _ = RequestResult::parse(&raw);
        let _ = MaintenanceNotice::parse(&raw);
        let _ = raw.parse::<DisruptionTolerance>();
    }

    #[test]
    fn mutated_reports_never_panic(gpu in 0usize..8, field in "[a-zA-Z]{1,12}", value in proptest::prelude::any::<i64>(), text in "\\PC{0,40}") {
        let mut v = incident();
        v["gpus"][gpu][&field] = json!(value);
        let _ = GpuReport::parse(&v.to_string());
        v["gpus"][gpu]["uuid"] = json!(text.clone());
        let _ = GpuReport::parse(&v.to_string());
        v["gpus"][gpu]["pciBusId"] = json!(text);
        let _ = GpuReport::parse(&v.to_string());
    }
}
