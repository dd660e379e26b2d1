//! The executor's DCGM diagnostic: a `gpuhealth.io/diagnostics-request`'s
//! GPUs (UUIDs) and level in, the answer's outcome, message and
//! `diagnostics` out. [`crate::dcgm`] is the boundary with dcgmi; this is
//! the mapping between what it reads and the contract.

use std::{collections::HashMap, path::PathBuf, time::Duration};

use gpuhealth_api::contract::{
    DiagnosticTest, DiagnosticsLevel, DiagnosticsResult, DiagnosticsVerdict, MAX_DIAGNOSTIC_TESTS,
    Outcome, TestVerdict,
};
use k8s_openapi::{
    api::core::v1::Node,
    jiff::{SignedDuration, Timestamp},
};

use crate::{
    backend::Backend,
    dcgm::{self, DcgmError, DiagReport, Level, Verdict},
};

/// Kept back from the request's deadline: the answer must be on the Node
/// before the operator's own deadline passes, and a killed dcgmi may take
/// a few seconds to be reaped.
pub const MARGIN: Duration = Duration::from_secs(5);

/// The most tests an answer keeps (the contract's bound).
const MAX_TESTS: usize = MAX_DIAGNOSTIC_TESTS;
/// The most characters of a test's detail kept.
const MAX_DETAIL: usize = 256;
/// The contract's bounds, in bytes, on a test's name and DCGM's version.
const MAX_NAME: usize = 64;
const MAX_VERSION: usize = 64;

/// Where DCGM is: the executor's `--dcgmi` and `--dcgm-host`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Dcgm {
    pub dcgmi: PathBuf,
    /// The host engine's address; dcgmi's default (`localhost`) when `None`.
    pub host: Option<String>,
}

/// What a diagnostic found, and the answer it makes.
#[derive(Clone, Debug, PartialEq)]
pub struct Diagnosed {
    pub outcome: Outcome,
    pub message: String,
    pub result: DiagnosticsResult,
}

impl Diagnosed {
    fn found(result: DiagnosticsResult) -> Diagnosed {
        Diagnosed {
            outcome: outcome_of(result.verdict),
            message: result.summary(),
            result,
        }
    }

    /// No report to read: `why` says what happened instead.
    fn without_report(
        level: DiagnosticsLevel,
        verdict: DiagnosticsVerdict,
        version: Option<String>,
        why: String,
    ) -> Diagnosed {
        Diagnosed {
            outcome: outcome_of(verdict),
            message: why,
            result: DiagnosticsResult {
                level,
                verdict,
                dcgm_version: version.map(|v| fit(&v, MAX_VERSION)),
                tests: Vec::new(),
            },
        }
    }
}

fn outcome_of(verdict: DiagnosticsVerdict) -> Outcome {
    if verdict.passed() {
        Outcome::Succeeded
    } else {
        Outcome::Failed
    }
}

/// When a request made at `requested_at` with `timeout` must be answered.
pub fn deadline(requested_at: Timestamp, timeout: Duration) -> Timestamp {
    SignedDuration::try_from(timeout)
        .ok()
        .and_then(|t| requested_at.checked_add(t).ok())
        .unwrap_or(Timestamp::MAX)
}

/// How long dcgmi may run: until [`MARGIN`] before `deadline`; `None` when
/// that has passed.
pub fn budget(deadline: Timestamp, now: Timestamp) -> Option<Duration> {
    let left = Duration::try_from(deadline.duration_since(now)).ok()?;
    left.checked_sub(MARGIN).filter(|b| !b.is_zero())
}

/// Runs DCGM's diagnostic at `level` on `gpus` (UUIDs), to be answered by
/// `deadline` (the request's time plus its timeout).
pub async fn carry_out<B: Backend>(
    backend: &mut B,
    node: &Node,
    dcgm: &Dcgm,
    level: DiagnosticsLevel,
    gpus: &[String],
    deadline: Timestamp,
) -> Diagnosed {
    let not_run = |verdict, why| Diagnosed::without_report(level, verdict, None, why);
    let dcgm_level = match level {
        DiagnosticsLevel::Quick => Level::Quick,
        DiagnosticsLevel::Medium => Level::Medium,
        DiagnosticsLevel::None => {
            return not_run(
                DiagnosticsVerdict::Error,
                "level None is no diagnostic".into(),
            );
        }
    };
    let indices = match backend.gpu_indices(node, gpus).await {
        Ok(indices) => indices,
        Err(why) => return not_run(DiagnosticsVerdict::Error, why),
    };
    // After the lookup, which may itself wait on NVML.
    let Some(budget) = budget(deadline, Timestamp::now()) else {
        return not_run(
            DiagnosticsVerdict::TimedOut,
            format!("not run: no time left before its deadline, {deadline}"),
        );
    };
    let run = match dcgm::diag_args(dcgm_level, &indices, dcgm.host.as_deref()) {
        Ok(args) => dcgm::run(&dcgm.dcgmi, &args, budget).await,
        Err(e) => Err(e),
    };
    judged(level, gpus, &indices, run)
}

/// The answer to dcgmi's run on `gpus`, whose indices are `indices` (in
/// the same order).
pub fn judged(
    level: DiagnosticsLevel,
    gpus: &[String],
    indices: &[u32],
    run: Result<DiagReport, DcgmError>,
) -> Diagnosed {
    let report = match run {
        Ok(report) => report,
        Err(e @ DcgmError::TimedOut { .. }) => {
            return Diagnosed::without_report(
                level,
                DiagnosticsVerdict::TimedOut,
                None,
                e.to_string(),
            );
        }
        Err(e) => {
            let version = match &e {
                DcgmError::Runtime { version, .. } => version.clone(),
                _ => None,
            };
            return Diagnosed::without_report(
                level,
                DiagnosticsVerdict::Error,
                version,
                e.to_string(),
            );
        }
    };
    let verdict = match report.overall() {
        Ok(Verdict::Fail) => DiagnosticsVerdict::Fail,
        Ok(Verdict::Warn) => DiagnosticsVerdict::Warn,
        Ok(Verdict::Pass) => DiagnosticsVerdict::Pass,
        // `overall` gives neither; a run without a verdict is no pass.
        Ok(Verdict::Skip | Verdict::NotRun) | Err(_) => {
            return Diagnosed::without_report(
                level,
                DiagnosticsVerdict::Error,
                report.version,
                DcgmError::NothingRun.to_string(),
            );
        }
    };
    let uuid_of: HashMap<u32, &String> = indices.iter().copied().zip(gpus).collect();
    let tests = report
        .tests
        .iter()
        .filter_map(|t| test(t, &uuid_of))
        .collect();
    Diagnosed::found(DiagnosticsResult {
        level,
        verdict,
        dcgm_version: report.version.map(|v| fit(&v, MAX_VERSION)),
        tests: bounded(tests),
    })
}

/// One of DCGM's verdicts, its GPU by UUID; `None` for a test not run.
fn test(t: &dcgm::TestVerdict, uuid_of: &HashMap<u32, &String>) -> Option<DiagnosticTest> {
    let verdict = match t.verdict {
        Verdict::Pass => TestVerdict::Pass,
        Verdict::Warn => TestVerdict::Warn,
        Verdict::Fail => TestVerdict::Fail,
        Verdict::Skip => TestVerdict::Skip,
        Verdict::NotRun => return None,
    };
    let gpu = t.gpu.and_then(|i| uuid_of.get(&i).map(|u| (*u).clone()));
    // A GPU not asked for (DCGM should name none): said in the detail, as
    // the contract's `gpu` takes only a UUID.
    let stray = t.gpu.filter(|_| gpu.is_none()).map(|i| format!("GPU {i}"));
    let detail = match (stray, &t.detail) {
        (Some(s), Some(d)) => Some(format!("{s}: {d}")),
        (Some(s), None) => Some(s),
        (None, d) => d.clone(),
    };
    Some(DiagnosticTest {
        name: fit(&t.name, MAX_NAME),
        gpu,
        verdict,
        detail: detail.map(|d| cut(&d, MAX_DETAIL)),
    })
}

/// At most [`MAX_TESTS`], in DCGM's order: failures and warnings first
/// to be kept, as they are what the answer is about.
fn bounded(tests: Vec<DiagnosticTest>) -> Vec<DiagnosticTest> {
    if tests.len() <= MAX_TESTS {
        return tests;
    }
    let notable = |t: &DiagnosticTest| matches!(t.verdict, TestVerdict::Fail | TestVerdict::Warn);
    let mut others = MAX_TESTS.saturating_sub(tests.iter().filter(|t| notable(t)).count());
    let mut kept = Vec::with_capacity(MAX_TESTS);
    for t in tests {
        if kept.len() == MAX_TESTS {
            break;
        }
        if notable(&t) {
            kept.push(t);
        } else if others > 0 {
            others -= 1;
            kept.push(t);
        }
    }
    kept
}

/// `text`, cut to at most `max` characters, an ellipsis marking the cut.
fn cut(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        None => text.to_owned(),
        Some(_) => text
            .chars()
            .take(max.saturating_sub(1))
            .chain(['…'])
            .collect(),
    }
}

/// `text`, cut to at most `max` bytes on a character's boundary, an
/// ellipsis marking the cut.
pub fn fit(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let room = max.saturating_sub('…'.len_utf8());
    let end = (0..=room)
        .rev()
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(0);
    format!("{}…", &text[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    const GPU0: &str = "GPU-00000000-aaaa";
    const GPU1: &str = "GPU-11111111-bbbb";

    fn gpus() -> Vec<String> {
        vec![GPU0.to_owned(), GPU1.to_owned()]
    }

    fn verdict(
        name: &str,
        gpu: Option<u32>,
        verdict: Verdict,
        detail: Option<&str>,
    ) -> dcgm::TestVerdict {
        dcgm::TestVerdict {
            category: "Hardware".into(),
            name: name.into(),
            gpu,
            verdict,
            detail: detail.map(Into::into),
            warnings: Vec::new(),
        }
    }

    fn report(tests: Vec<dcgm::TestVerdict>) -> DiagReport {
        DiagReport {
            version: Some("4.2.3".into()),
            tests,
            exit_code: Some(0),
        }
    }

    #[test]
    fn a_report_is_mapped_to_uuids_and_its_verdict() {
        // GPUs 3 and 5 as NVML numbers them now.
        let run = Ok(report(vec![
            verdict("software", None, Verdict::Pass, None),
            verdict("memory", Some(3), Verdict::Pass, None),
            verdict("memory", Some(5), Verdict::Fail, Some("read back differs")),
            verdict("pcie", Some(5), Verdict::Skip, None),
            verdict("targeted_power", None, Verdict::NotRun, None),
        ]));
        let d = judged(DiagnosticsLevel::Medium, &gpus(), &[3, 5], run);
        assert_eq!(d.outcome, Outcome::Failed);
        assert_eq!(d.result.verdict, DiagnosticsVerdict::Fail);
        assert_eq!(d.result.dcgm_version.as_deref(), Some("4.2.3"));
        let tests: Vec<_> = d
            .result
            .tests
            .iter()
            .map(|t| (t.name.as_str(), t.gpu.as_deref(), t.verdict))
            .collect();
        assert_eq!(
            tests,
            [
                ("software", None, TestVerdict::Pass),
                ("memory", Some(GPU0), TestVerdict::Pass),
                ("memory", Some(GPU1), TestVerdict::Fail),
                ("pcie", Some(GPU1), TestVerdict::Skip),
            ]
        );
        assert_eq!(
            d.message,
            format!("memory on {GPU1}: Fail (read back differs)")
        );
    }

    #[test]
    fn a_pass_or_a_warning_succeeds() {
        let pass = judged(
            DiagnosticsLevel::Quick,
            &gpus(),
            &[0, 1],
            Ok(report(vec![verdict(
                "software",
                Some(0),
                Verdict::Pass,
                None,
            )])),
        );
        assert_eq!(
            (pass.outcome, pass.result.verdict, pass.message.as_str()),
            (
                Outcome::Succeeded,
                DiagnosticsVerdict::Pass,
                "1 tests passed"
            )
        );
        let warn = judged(
            DiagnosticsLevel::Quick,
            &gpus(),
            &[0, 1],
            Ok(report(vec![verdict(
                "software",
                Some(1),
                Verdict::Warn,
                Some("persistence mode is off"),
            )])),
        );
        assert_eq!(
            (warn.outcome, warn.result.verdict),
            (Outcome::Succeeded, DiagnosticsVerdict::Warn)
        );
        assert!(warn.message.contains(GPU1), "{}", warn.message);
    }

    #[test]
    fn errors_are_timed_out_or_error_in_dcgmis_words() {
        let timed_out = judged(
            DiagnosticsLevel::Medium,
            &gpus(),
            &[0, 1],
            Err(DcgmError::TimedOut {
                after: Duration::from_secs(60),
            }),
        );
        assert_eq!(
            (timed_out.outcome, timed_out.result.verdict),
            (Outcome::Failed, DiagnosticsVerdict::TimedOut)
        );
        assert!(
            timed_out.message.contains("did not finish"),
            "{}",
            timed_out.message
        );
        assert!(timed_out.result.tests.is_empty());
        for (e, words) in [
            (
                DcgmError::NotFound {
                    path: "/usr/bin/dcgmi".into(),
                },
                "no dcgmi at /usr/bin/dcgmi",
            ),
            (
                DcgmError::Failed {
                    code: Some(249),
                    excerpt: "Error: Unable to start an embedded host engine.".into(),
                },
                "Unable to start an embedded host engine",
            ),
            (DcgmError::NothingRun, "dcgmi ran no test"),
        ] {
            let d = judged(DiagnosticsLevel::Quick, &gpus(), &[0, 1], Err(e));
            assert_eq!(
                (d.outcome, d.result.verdict),
                (Outcome::Failed, DiagnosticsVerdict::Error)
            );
            assert!(d.message.contains(words), "{}", d.message);
        }
        let runtime = judged(
            DiagnosticsLevel::Quick,
            &gpus(),
            &[0, 1],
            Err(DcgmError::Runtime {
                message: "a diagnostic is already running".into(),
                version: Some("4.2.3".into()),
                code: Some(217),
            }),
        );
        assert_eq!(runtime.result.dcgm_version.as_deref(), Some("4.2.3"));
        // Nothing that passed, warned or failed is no pass.
        let nothing = judged(
            DiagnosticsLevel::Quick,
            &gpus(),
            &[0, 1],
            Ok(report(vec![verdict(
                "software",
                None,
                Verdict::NotRun,
                None,
            )])),
        );
        assert_eq!(nothing.result.verdict, DiagnosticsVerdict::Error);
    }

    #[test]
    fn the_answer_keeps_within_the_contracts_bounds() {
        let long = "é".repeat(600);
        let mut tests: Vec<_> = (0..200)
            .map(|i| verdict(&"n".repeat(100), Some(i % 2), Verdict::Pass, Some(&long)))
            .collect();
        tests.push(verdict("memory", Some(1), Verdict::Fail, None));
        let mut r = report(tests);
        r.version = Some("v".repeat(100));
        let d = judged(DiagnosticsLevel::Quick, &gpus(), &[0, 1], Ok(r));
        assert_eq!(d.result.tests.len(), MAX_TESTS);
        // The failure is kept, at the end, where DCGM put it.
        assert_eq!(
            d.result.tests.last().map(|t| t.verdict),
            Some(TestVerdict::Fail)
        );
        let first = &d.result.tests[0];
        assert!(first.name.len() <= 64, "{}", first.name);
        assert_eq!(
            first.detail.as_deref().map(|d| d.chars().count()),
            Some(256)
        );
        assert!(
            d.result
                .dcgm_version
                .as_deref()
                .is_some_and(|v| v.len() <= 64)
        );
        // A GPU DCGM named that was not asked for: in words, not as a UUID.
        let stray = judged(
            DiagnosticsLevel::Quick,
            &gpus(),
            &[0, 1],
            Ok(report(vec![verdict(
                "software",
                Some(7),
                Verdict::Pass,
                None,
            )])),
        );
        assert_eq!(stray.result.tests[0].gpu, None);
        assert_eq!(stray.result.tests[0].detail.as_deref(), Some("GPU 7"));
        assert_eq!(fit("ab€cd", 5), "ab…");
        assert_eq!(fit("a€cd", 5), "a…");
        assert_eq!(fit("abc", 3), "abc");
    }

    #[test]
    fn the_budget_leaves_the_margin_before_the_deadline() {
        let now = Timestamp::UNIX_EPOCH;
        let at = |s: i64| Timestamp::from_second(s).expect("a time");
        assert_eq!(budget(at(65), now), Some(Duration::from_secs(60)));
        assert_eq!(budget(at(5), now), None);
        assert_eq!(budget(at(-10), now), None);
        assert_eq!(deadline(now, Duration::from_secs(65)), at(65));
    }
}
