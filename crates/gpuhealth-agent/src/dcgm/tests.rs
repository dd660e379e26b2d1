use super::*;

const QUICK_PASS: &str = include_str!("../../tests/fixtures/dcgm/quick-pass.json");
const MEDIUM_FAIL: &str = include_str!("../../tests/fixtures/dcgm/medium-fail.json");
const QUICK_WARNING: &str = include_str!("../../tests/fixtures/dcgm/quick-warning.json");
const RUNTIME_ERROR: &str = include_str!("../../tests/fixtures/dcgm/runtime-error.json");
const V3_MEDIUM_WARNING: &str = include_str!("../../tests/fixtures/dcgm/v3-medium-warning.json");

const STANDIN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../e2e/dcgmi-standin/dcgmi");

fn verdicts(report: &DiagReport) -> Vec<(&str, Option<u32>, Verdict)> {
    report
        .tests
        .iter()
        .map(|t| (t.name.as_str(), t.gpu, t.verdict))
        .collect()
}

#[test]
fn a_quick_pass_on_two_gpus() {
    let report = parse(QUICK_PASS.as_bytes()).expect("parses");
    assert_eq!(report.version.as_deref(), Some("4.4.1"));
    assert_eq!(
        verdicts(&report),
        [
            ("software", Some(0), Verdict::Pass),
            ("software", Some(1), Verdict::Pass)
        ]
    );
    assert!(report.tests.iter().all(|t| t.category == "Deployment"));
    assert_eq!(report.overall().expect("ran"), Verdict::Pass);
    assert_eq!(report.for_gpu(1).expect("ran"), Verdict::Pass);
}

#[test]
fn a_medium_run_whose_memory_test_fails_on_gpu_1() {
    let report = parse(MEDIUM_FAIL.as_bytes()).expect("parses");
    assert_eq!(
        verdicts(&report),
        [
            ("software", Some(0), Verdict::Pass),
            ("software", Some(1), Verdict::Pass),
            ("memory", Some(0), Verdict::Pass),
            ("memory", Some(1), Verdict::Fail),
            ("pcie", Some(0), Verdict::Pass),
            ("pcie", Some(1), Verdict::Pass),
        ]
    );
    let memory = &report.tests[3];
    assert_eq!(memory.category, "Hardware");
    let detail = memory.detail.as_deref().expect("the warning");
    assert!(detail.starts_with("GPU 1: 4 words read back"), "{detail}");
    assert_eq!(
        memory.warnings,
        [Warning {
            id: 58,
            category: 10,
            severity: 2
        }]
    );
    // Information is the detail only where there is no warning.
    assert_eq!(
        report.tests[2].detail.as_deref(),
        Some("Allocated 79.2 GiB of framebuffer")
    );
    assert_eq!(report.overall().expect("ran"), Verdict::Fail);
    assert_eq!(report.for_gpu(0).expect("ran"), Verdict::Pass);
    assert_eq!(report.for_gpu(1).expect("ran"), Verdict::Fail);
}

#[test]
fn a_warning_is_what_dcgmi_writes_and_its_exit_status_decides() {
    // DCGM 4.x: "Fail" in the JSON, exit status 226: a failure.
    let report = parse(QUICK_WARNING.as_bytes()).expect("parses");
    assert_eq!(report.overall().expect("ran"), Verdict::Fail);
    let software = &report.tests[1];
    assert_eq!(software.gpu, Some(1));
    assert_eq!(software.warnings[0].severity, 5);
    assert_eq!(
        software.detail.as_deref(),
        Some("GPU 1: persistence mode is disabled")
    );
    // DCGM 3.x: "Fail" in the JSON, exit status 0: a warning.
    let mut report = parse(V3_MEDIUM_WARNING.as_bytes()).expect("parses");
    report.failures_as_warnings();
    assert_eq!(report.overall().expect("ran"), Verdict::Warn);
    assert_eq!(report.for_gpu(0).expect("ran"), Verdict::Pass);
    assert_eq!(report.for_gpu(1).expect("ran"), Verdict::Warn);
}

#[test]
fn dcgm_3_output_is_read_too() {
    let report = parse(V3_MEDIUM_WARNING.as_bytes()).expect("parses");
    assert_eq!(report.version.as_deref(), Some("3.3.9"));
    let persistence = report
        .tests
        .iter()
        .find(|t| t.name == "Persistence Mode")
        .expect("the check");
    assert_eq!(
        (persistence.gpu, persistence.verdict),
        (Some(1), Verdict::Fail)
    );
    assert_eq!(
        persistence.detail.as_deref(),
        Some("GPU 1: persistence mode is disabled")
    );
    assert_eq!(persistence.warnings[0].id, 29);
    let inforom = report
        .tests
        .iter()
        .find(|t| t.name == "Inforom")
        .expect("the check");
    assert_eq!((inforom.gpu, inforom.verdict), (None, Verdict::Skip));
    let pcie: Vec<_> = report.tests.iter().filter(|t| t.name == "PCIe").collect();
    assert_eq!(pcie[0].gpu, Some(0));
    assert_eq!(
        pcie[0].detail.as_deref(),
        Some("GPU 0 host-to-device bandwidth 24.6 GB/s")
    );
    assert_eq!(
        (pcie[1].gpu, pcie[1].category.as_str()),
        (Some(1), "Integration")
    );
    assert_eq!(report.overall().expect("ran"), Verdict::Fail);
}

#[test]
fn a_runtime_error_is_an_error() {
    match parse(RUNTIME_ERROR.as_bytes()) {
        Err(DcgmError::Runtime {
            message, version, ..
        }) => {
            assert!(message.contains("another diagnostic"), "{message}");
            assert_eq!(version.as_deref(), Some("4.4.1"));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn bad_truncated_or_oversized_output_is_an_error() {
    for cut in [
        1,
        QUICK_PASS.len() / 3,
        QUICK_PASS.len() / 2,
        QUICK_PASS.len() - 3,
    ] {
        let truncated = &QUICK_PASS.as_bytes()[..cut];
        assert!(
            matches!(parse(truncated), Err(DcgmError::BadJson(_))),
            "cut at {cut}"
        );
    }
    assert!(matches!(parse(b""), Err(DcgmError::NoJson)));
    assert!(matches!(
        parse(b"Error: unable to establish a connection to the specified host: x\n"),
        Err(DcgmError::NoJson)
    ));
    assert!(matches!(
        parse(b"{\"iterations\": []}"),
        Err(DcgmError::BadJson(_))
    ));
    assert!(matches!(parse(b"[1, 2]"), Err(DcgmError::NoJson)));
    assert!(matches!(parse(b"{} trailing"), Err(DcgmError::BadJson(_))));
    let odd = br#"{"DCGM Diagnostic": {"test_categories": [{"category": "Deployment",
        "tests": [{"name": "software", "results": [{"status": "Maybe"}]}]}]}}"#;
    assert!(matches!(parse(odd), Err(DcgmError::BadJson(_))));
    let deep = "[".repeat(10_000);
    assert!(matches!(
        parse(format!("{{\"a\": {deep}").as_bytes()),
        Err(DcgmError::BadJson(_))
    ));
    let huge = vec![b' '; MAX_OUTPUT + 1];
    assert!(matches!(parse(&huge), Err(DcgmError::TooLarge { .. })));
}

#[test]
fn text_before_the_json_is_skipped() {
    let output = format!(
        "Error: unable to establish a connection to the specified host: 10.0.0.7\n{QUICK_PASS}"
    );
    assert_eq!(
        parse(output.as_bytes())
            .expect("parses")
            .overall()
            .expect("ran"),
        Verdict::Pass
    );
}

#[test]
fn the_overall_rule() {
    let test = |verdict, gpu| TestVerdict {
        category: "Deployment".into(),
        name: "software".into(),
        gpu,
        verdict,
        detail: None,
        warnings: Vec::new(),
    };
    let report = |tests: Vec<TestVerdict>| DiagReport {
        version: None,
        tests,
        exit_code: None,
    };
    use Verdict::*;
    for (verdicts, overall) in [
        (vec![Pass, Skip, Warn], Some(Warn)),
        (vec![Warn, Fail, Pass], Some(Fail)),
        (vec![Pass, Skip, NotRun], Some(Pass)),
        (vec![Skip, NotRun], None),
        (vec![], None),
    ] {
        let r = report(verdicts.iter().map(|&v| test(v, Some(0))).collect());
        match overall {
            Some(v) => assert_eq!(r.overall().expect("ran"), v, "{verdicts:?}"),
            None => assert!(matches!(r.overall(), Err(DcgmError::NothingRun))),
        }
    }
    // A test on no GPU in particular counts for every GPU.
    let r = report(vec![
        test(Pass, Some(0)),
        test(Fail, Some(1)),
        test(Warn, None),
    ]);
    assert_eq!(r.for_gpu(0).expect("ran"), Warn);
    assert_eq!(r.for_gpu(1).expect("ran"), Fail);
    assert_eq!(r.for_gpu(2).expect("ran"), Warn);
}

#[test]
fn a_summary_counts_where_no_result_does() {
    // No results, only a summary (as for a test on no entity).
    let json = br#"{"DCGM Diagnostic": {"test_categories": [{"category": "Stress",
        "tests": [{"name": "eud", "test_summary": {"status": "Fail",
          "warnings": [{"warning": "it broke", "error_id": 7, "error_category": 7, "error_severity": 4}]}},
          {"name": "pulse_test"}]}]}}"#;
    let report = parse(json).expect("parses");
    assert_eq!(
        verdicts(&report),
        [
            ("eud", None, Verdict::Fail),
            ("pulse_test", None, Verdict::NotRun)
        ]
    );
    assert_eq!(report.tests[0].detail.as_deref(), Some("it broke"));
    // A summary worse than every result is kept; nulls are skipped.
    let json = br#"{"DCGM Diagnostic": {"test_categories": [null, {"category": "Hardware",
        "tests": [{"name": "memory", "results": [null, {"entity_group": "GPU",
          "entity_group_id": 1, "entity_id": 3, "status": "Pass", "warnings": [null]}],
          "test_summary": {"status": "Fail"}}]}]}}"#;
    let report = parse(json).expect("parses");
    assert_eq!(
        verdicts(&report),
        [
            ("memory", Some(3), Verdict::Pass),
            ("memory", None, Verdict::Fail)
        ]
    );
}

#[test]
fn warning_text_is_bounded() {
    let long = "é".repeat(3 * MAX_DETAIL);
    let json = format!(
        r#"{{"DCGM Diagnostic": {{"test_categories": [{{"category": "Hardware",
        "tests": [{{"name": "memory", "results": [{{"entity_group": "GPU", "entity_group_id": 1,
          "entity_id": 0, "status": "Fail", "warnings": [{{"warning": "{long}"}}, {{"warning": "b"}}]}}]}}]}}]}}}}"#
    );
    let report = parse(json.as_bytes()).expect("parses");
    let detail = report.tests[0].detail.as_deref().expect("detail");
    assert_eq!(detail.chars().count(), MAX_DETAIL);
    assert!(detail.ends_with('…'));
}

#[test]
fn the_arguments_of_a_run() {
    assert_eq!(
        diag_args(Level::Quick, &[0, 1], None).expect("valid"),
        ["diag", "-r", "1", "-j", "-i", "0,1"]
    );
    assert_eq!(
        diag_args(Level::Medium, &[3], Some("10.0.0.7:5555")).expect("valid"),
        [
            "diag",
            "-r",
            "2",
            "-j",
            "-i",
            "3",
            "--host",
            "10.0.0.7:5555"
        ]
    );
    assert!(diag_args(Level::Quick, &[], None).is_err());
    for host in ["", "-j", "a b", "a\nb"] {
        assert!(
            diag_args(Level::Quick, &[0], Some(host)).is_err(),
            "{host:?}"
        );
    }
}

/// Runs the stand-in with `behaviour` in its behaviour file, through
/// `env` (the test process's own environment stays as it is).
async fn run_standin(
    name: &str,
    behaviour: Option<&str>,
    args: &[String],
    timeout: Duration,
) -> Result<DiagReport, DcgmError> {
    let file = std::env::temp_dir().join(format!("gpuhealth-dcgmi-{name}-{}", std::process::id()));
    match behaviour {
        Some(b) => std::fs::write(&file, b).expect("write the behaviour"),
        None => {
            let _ = std::fs::remove_file(&file);
        }
    }
    let mut all = vec![
        format!("GPUHEALTH_DCGMI_STANDIN_FILE={}", file.display()),
        STANDIN.to_owned(),
    ];
    all.extend_from_slice(args);
    let result = run(Path::new("/usr/bin/env"), &all, timeout).await;
    let _ = std::fs::remove_file(&file);
    result
}

const BUDGET: Duration = Duration::from_secs(30);

#[tokio::test]
async fn the_standin_passes() {
    let args = diag_args(Level::Quick, &[0, 1], None).expect("valid");
    let report = run_standin("pass", None, &args, BUDGET)
        .await
        .expect("a report");
    assert_eq!(report.exit_code, Some(0));
    assert_eq!(
        verdicts(&report),
        [
            ("software", Some(0), Verdict::Pass),
            ("software", Some(1), Verdict::Pass)
        ]
    );
    assert_eq!(report.overall().expect("ran"), Verdict::Pass);
    let args = diag_args(Level::Medium, &[2], Some("localhost")).expect("valid");
    let report = run_standin("pass-medium", Some("pass\n"), &args, BUDGET)
        .await
        .expect("a report");
    assert_eq!(
        verdicts(&report),
        [
            ("software", Some(2), Verdict::Pass),
            ("memory", Some(2), Verdict::Pass),
            ("pcie", Some(2), Verdict::Pass)
        ]
    );
}

#[tokio::test]
async fn the_standin_fails_and_its_report_is_still_read() {
    let args = diag_args(Level::Medium, &[0, 1], None).expect("valid");
    let report = run_standin("fail", Some("fail 1"), &args, BUDGET)
        .await
        .expect("a report");
    assert_eq!(report.exit_code, Some(205));
    assert_eq!(report.overall().expect("ran"), Verdict::Fail);
    assert_eq!(report.for_gpu(0).expect("ran"), Verdict::Pass);
    assert_eq!(report.for_gpu(1).expect("ran"), Verdict::Fail);
    let memory = report
        .tests
        .iter()
        .find(|t| t.name == "memory" && t.gpu == Some(1))
        .expect("memory on GPU 1");
    assert_eq!(
        (memory.verdict, memory.warnings[0].severity),
        (Verdict::Fail, 2)
    );
    // A warning: "Fail" and exit status 226, as DCGM 4.x.
    let args = diag_args(Level::Quick, &[0], None).expect("valid");
    let report = run_standin("warn", Some("warn"), &args, BUDGET)
        .await
        .expect("a report");
    assert_eq!(report.exit_code, Some(226));
    assert_eq!(report.overall().expect("ran"), Verdict::Fail);
    assert_eq!(report.tests[0].warnings[0].severity, 5);
}

#[tokio::test]
async fn a_hung_dcgmi_is_killed_at_the_timeout() {
    // A host nobody else uses marks this run's process.
    let marker = format!("hang-{}.invalid", std::process::id());
    let args = diag_args(Level::Quick, &[0], Some(&marker)).expect("valid");
    let started = std::time::Instant::now();
    let result = run_standin("hang", Some("hang"), &args, Duration::from_millis(1500)).await;
    assert!(
        matches!(result, Err(DcgmError::TimedOut { .. })),
        "{result:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    // Killed and reaped: no process left with the marker.
    let left: Vec<_> = std::fs::read_dir("/proc")
        .expect("/proc")
        .flatten()
        .filter(|e| {
            std::fs::read(e.path().join("cmdline"))
                .is_ok_and(|c| c.windows(marker.len()).any(|w| w == marker.as_bytes()))
        })
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

#[tokio::test]
async fn a_missing_dcgmi_and_one_that_cannot_run() {
    let args = diag_args(Level::Quick, &[0], None).expect("valid");
    let result = run(Path::new("/no/such/dcgmi"), &args, BUDGET).await;
    assert!(
        matches!(&result, Err(DcgmError::NotFound { path }) if path == Path::new("/no/such/dcgmi")),
        "{result:?}"
    );
    // No host engine: a line of text and a nonzero exit.
    let args = diag_args(Level::Quick, &[0], Some("10.0.0.7")).expect("valid");
    match run_standin("unreachable", Some("unreachable"), &args, BUDGET).await {
        Err(DcgmError::Failed { code, excerpt }) => {
            assert_eq!(code, Some(249));
            assert!(excerpt.contains("10.0.0.7"), "{excerpt}");
        }
        other => panic!("{other:?}"),
    }
    // A usage error: dcgmi's parser on stderr, exit status 1.
    let args = ["diag", "-r", "1", "-j", "-i", "0", "--bogus"].map(str::to_owned);
    match run_standin("usage", None, &args, BUDGET).await {
        Err(DcgmError::Failed { code, excerpt }) => {
            assert_eq!(code, Some(1));
            assert!(excerpt.starts_with("PARSE ERROR"), "{excerpt}");
        }
        other => panic!("{other:?}"),
    }
    // A runtime error carries dcgmi's exit status.
    match run_standin("error", Some("error"), &args[..6], BUDGET).await {
        Err(DcgmError::Runtime { code, message, .. }) => {
            assert_eq!(code, Some(217));
            assert!(message.contains("already running"), "{message}");
        }
        other => panic!("{other:?}"),
    }
}
