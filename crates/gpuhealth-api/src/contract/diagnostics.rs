//! DCGM diagnostics before a repaired GPU serves again: the operator's
//! request (`gpuhealth.io/diagnostics-request`) and what the executor found,
//! carried in its answer ([`super::RequestResult::diagnostics`]) and kept in
//! the incident's history.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{
    AnnotationValue, ContractError, DIAGNOSTICS_REQUEST_ANNOTATION, RequestId,
    checks::{bounded_text, gpu_uuid, gpu_uuids, invalid},
};
use crate::{Duration, vocabulary::words};

/// The most tests one answer keeps (a Medium run on eight GPUs has a few
/// dozen results).
pub const MAX_TESTS: usize = 128;
/// The most a diagnostic may be given.
pub const MAX_TIMEOUT: Duration = Duration::from_hours(1);

words! {
    /// How thoroughly DCGM checks a repaired GPU (`dcgmi diag -r`).
    #[derive(Default)]
    pub enum DiagnosticsLevel {
        /// No diagnostic: signals staying clear suffice. (Not `Off`: YAML
        /// 1.1, which kubectl reads manifests as, takes that for `false`.)
        #[default]
        None,
        /// DCGM level 1: the software and deployment checks (seconds).
        Quick,
        /// DCGM level 2: level 1 with the PCIe and memory tests (about two
        /// minutes).
        Medium,
    }
}

words! {
    /// DCGM's verdict on one test, on one GPU or on none in particular.
    pub enum TestVerdict {
        Pass,
        /// DCGM judged it a warning: noted, not a failure.
        Warn,
        Fail,
        /// DCGM skipped it (not supported here).
        Skip,
    }
}

words! {
    /// How a diagnostic ended.
    pub enum DiagnosticsVerdict {
        /// Every test that ran passed.
        Pass,
        /// Nothing failed; some test warned.
        Warn,
        /// A test failed.
        Fail,
        /// dcgmi did not finish within the time given and was killed.
        TimedOut,
        /// dcgmi could not run it (no dcgmi, no host engine, a DCGM
        /// error): `message` says why.
        Error,
    }
}

impl DiagnosticsVerdict {
    /// Whether the GPU may serve again on it.
    pub fn passed(self) -> bool {
        matches!(self, DiagnosticsVerdict::Pass | DiagnosticsVerdict::Warn)
    }
}

/// `gpuhealth.io/diagnostics-request`: run DCGM's diagnostic at `level` on
/// `gpus` (UUIDs) and answer within `timeout` of `requestedAt`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DiagnosticsRequest {
    pub id: RequestId,
    pub gpus: Vec<String>,
    pub level: DiagnosticsLevel,
    pub timeout: Duration,
    pub requested_at: Time,
}

impl AnnotationValue for DiagnosticsRequest {
    const ANNOTATION: &'static str = DIAGNOSTICS_REQUEST_ANNOTATION;

    fn check(&self) -> Result<(), ContractError> {
        gpu_uuids(Self::ANNOTATION, &self.gpus)?;
        if self.level == DiagnosticsLevel::None {
            return Err(invalid(
                Self::ANNOTATION,
                "level",
                "must be Quick or Medium",
            ));
        }
        if self.timeout == Duration::ZERO || self.timeout > MAX_TIMEOUT {
            return Err(invalid(
                Self::ANNOTATION,
                "timeout",
                format!("must be more than 0s and at most {MAX_TIMEOUT}"),
            ));
        }
        Ok(())
    }
}

/// What a diagnostic found, as the executor answered it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DiagnosticsResult {
    pub level: DiagnosticsLevel,
    pub verdict: DiagnosticsVerdict,
    /// The DCGM version dcgmi reported.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dcgm_version: Option<String>,
    /// Each test's verdict, per GPU where DCGM gave one (at most 128).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tests: Vec<DiagnosticTest>,
}

/// One test's verdict.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DiagnosticTest {
    /// DCGM's name for the test (`software`, `memory`, `pcie`, ...).
    pub name: String,
    /// The GPU (UUID) it is about; none for a test on no GPU in particular.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<String>,
    pub verdict: TestVerdict,
    /// DCGM's warning or information, cut to 256 characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

impl DiagnosticsResult {
    /// The failed and warned tests, in words: `memory on GPU-1234: Fail
    /// (…)`; `all N tests passed` when there are none.
    pub fn summary(&self) -> String {
        let notable: Vec<String> = self
            .tests
            .iter()
            .filter(|t| matches!(t.verdict, TestVerdict::Fail | TestVerdict::Warn))
            .map(|t| {
                let on = t
                    .gpu
                    .as_deref()
                    .map(|g| format!(" on {g}"))
                    .unwrap_or_default();
                let detail = t
                    .detail
                    .as_deref()
                    .map(|d| format!(" ({d})"))
                    .unwrap_or_default();
                format!("{}{on}: {}{detail}", t.name, t.verdict)
            })
            .collect();
        if notable.is_empty() {
            let ran = self
                .tests
                .iter()
                .filter(|t| t.verdict == TestVerdict::Pass)
                .count();
            format!("{ran} tests passed")
        } else {
            notable.join("; ")
        }
    }

    pub(super) fn check(&self, annotation: &'static str) -> Result<(), ContractError> {
        let field = |f: String| format!("diagnostics.{f}");
        if self.tests.len() > MAX_TESTS {
            return Err(invalid(
                annotation,
                field("tests".into()),
                format!("more than {MAX_TESTS} tests"),
            ));
        }
        if let Some(v) = &self.dcgm_version {
            bounded_text(v, 64).map_err(|r| invalid(annotation, field("dcgmVersion".into()), r))?;
        }
        for (i, test) in self.tests.iter().enumerate() {
            bounded_text(&test.name, 64)
                .map_err(|r| invalid(annotation, field(format!("tests[{i}].name")), r))?;
            if let Some(gpu) = &test.gpu {
                gpu_uuid(gpu)
                    .map_err(|r| invalid(annotation, field(format!("tests[{i}].gpu")), r))?;
            }
            if let Some(detail) = &test.detail {
                bounded_text(detail, 1024)
                    .map_err(|r| invalid(annotation, field(format!("tests[{i}].detail")), r))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::jiff::Timestamp;

    fn request(level: DiagnosticsLevel, timeout: Duration, gpus: &[&str]) -> DiagnosticsRequest {
        DiagnosticsRequest {
            id: "inc-1-reset-1-diagnostics".parse().expect("id"),
            gpus: gpus.iter().map(|g| (*g).to_owned()).collect(),
            level,
            timeout,
            requested_at: Time(Timestamp::UNIX_EPOCH),
        }
    }

    #[test]
    fn a_request_round_trips_and_bad_ones_name_their_field() {
        let good = request(
            DiagnosticsLevel::Quick,
            Duration::from_mins(5),
            &["GPU-0a1b2c3d"],
        );
        let raw = good.to_annotation();
        assert!(raw.contains(r#""level":"Quick""#), "{raw}");
        assert!(raw.contains(r#""timeout":"5m""#), "{raw}");
        assert_eq!(DiagnosticsRequest::parse(&raw), Ok(good));
        for (bad, field) in [
            (
                request(
                    DiagnosticsLevel::None,
                    Duration::from_mins(5),
                    &["GPU-0a1b2c3d"],
                ),
                "level",
            ),
            (
                request(DiagnosticsLevel::Quick, Duration::ZERO, &["GPU-0a1b2c3d"]),
                "timeout",
            ),
            (
                request(
                    DiagnosticsLevel::Quick,
                    Duration::from_hours(2),
                    &["GPU-0a1b2c3d"],
                ),
                "timeout",
            ),
            (
                request(DiagnosticsLevel::Quick, Duration::from_mins(5), &[]),
                "gpus",
            ),
            (
                request(DiagnosticsLevel::Quick, Duration::from_mins(5), &["0"]),
                "gpus[0]",
            ),
        ] {
            match DiagnosticsRequest::parse(&bad.to_annotation()) {
                Err(ContractError::Invalid { field: f, .. }) => assert_eq!(f, field),
                other => panic!("{bad:?}: {other:?}"),
            }
        }
    }

    #[test]
    fn the_summary_names_what_failed_or_warned() {
        let test = |name: &str, gpu: Option<&str>, verdict, detail: Option<&str>| DiagnosticTest {
            name: name.into(),
            gpu: gpu.map(Into::into),
            verdict,
            detail: detail.map(Into::into),
        };
        let mut result = DiagnosticsResult {
            level: DiagnosticsLevel::Medium,
            verdict: DiagnosticsVerdict::Pass,
            dcgm_version: Some("4.2.3".into()),
            tests: vec![
                test("software", None, TestVerdict::Pass, None),
                test("memory", Some("GPU-0a1b2c3d"), TestVerdict::Pass, None),
            ],
        };
        assert_eq!(result.summary(), "2 tests passed");
        result.tests.push(test(
            "memory",
            Some("GPU-99aabbcc"),
            TestVerdict::Fail,
            Some("DBE pending"),
        ));
        assert_eq!(
            result.summary(),
            "memory on GPU-99aabbcc: Fail (DBE pending)"
        );
    }
}
