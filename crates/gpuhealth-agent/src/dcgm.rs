//! NVIDIA DCGM diagnostics through the node's `dcgmi`, so that a repaired
//! GPU is put through DCGM's own checks before it serves again.
//!
//! The agent runs `dcgmi diag -r <level> -j -i <gpus> [--host <address>]`
//! under a time budget and reads the JSON dcgmi prints into one verdict per
//! test and GPU. dcgmi's JSON comes in two shapes:
//!
//! - DCGM 4.x: everything under `"DCGM Diagnostic"`; each test has one
//!   result per entity (`entity_group` `"GPU"`, `entity_group_id` 1,
//!   `entity_id` the GPU) and a `test_summary`; the version is under
//!   `metadata`; `info` is a list of strings.
//! - DCGM 3.x: under `"DCGM GPU Diagnostic"`; each software check is a
//!   test of its own with a single result (`gpu_id` a number, present only
//!   with a warning, whose text is under `"warnings"`), the plugin tests
//!   have a result per GPU (`gpu_id` a string); the version is at the top;
//!   `info` is one string.
//!
//! In both, a test that was not run has no result, and a test result that
//! DCGM judged a warning is written `"Fail"` (only dcgmi's table says
//! `"Warn"`). dcgmi's exit status is DCGM's own judgement: 0 when nothing
//! failed, 226 (`DCGM_ST_NVVS_ERROR`) or 205 (`DCGM_ST_NVVS_ISOLATE_ERROR`)
//! when something did, with the JSON printed all the same. DCGM 3.x exits 0
//! on a warning, so a `"Fail"` under exit status 0 is read as a warning;
//! DCGM 4.x exits 226 on one, so there it stays a failure. When dcgmi
//! cannot run the diagnostic it prints `{"DCGM Diagnostic": {"runtime_error":
//! …, "version": …}}` and exits with DCGM's status; when it cannot reach a
//! host engine at all it prints a line of text, not JSON.

use std::{
    ffi::OsStr,
    path::{Path, PathBuf},
    process::{ExitStatus, Stdio},
    time::Duration,
};

use serde::Deserialize;
use tokio::io::{AsyncRead, AsyncReadExt};

/// The most dcgmi output read: a Medium run on eight GPUs prints a few tens
/// of KiB.
pub const MAX_OUTPUT: usize = 1 << 20;

/// The most characters of warning text kept per verdict.
const MAX_DETAIL: usize = 512;

/// The most characters of dcgmi's own words kept in an error.
const MAX_EXCERPT: usize = 512;

/// The most stderr kept (the rest is read and dropped, so that dcgmi never
/// blocks on a full pipe).
const MAX_STDERR: usize = 64 * 1024;

/// How long a killed dcgmi gets to be reaped: one stuck in the driver may
/// not die at once, and the budget must hold regardless.
const REAP_GRACE: Duration = Duration::from_secs(5);

/// `entity_group_id` of a GPU (`DCGM_FE_GPU`).
const ENTITY_GROUP_GPU: u32 = 1;

/// A DCGM diagnostic level (`dcgmi diag -r`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// `-r 1`: the software deployment checks (seconds).
    Quick,
    /// `-r 2`: Quick, with the PCIe and memory tests (about two minutes).
    Medium,
}

impl Level {
    /// The value of `-r`.
    pub fn run_arg(self) -> &'static str {
        match self {
            Level::Quick => "1",
            Level::Medium => "2",
        }
    }
}

/// One test's verdict, as DCGM gave it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Verdict {
    Pass,
    Warn,
    Fail,
    Skip,
    NotRun,
}

impl Verdict {
    fn from_status(status: &str) -> Option<Verdict> {
        Some(match status {
            "Pass" => Verdict::Pass,
            "Warn" => Verdict::Warn,
            "Fail" => Verdict::Fail,
            "Skip" => Verdict::Skip,
            "Not Run" => Verdict::NotRun,
            _ => return None,
        })
    }

    /// How bad: not run and skipped below a pass, a pass below a warning,
    /// a warning below a failure.
    fn rank(self) -> u8 {
        match self {
            Verdict::NotRun => 0,
            Verdict::Skip => 1,
            Verdict::Pass => 2,
            Verdict::Warn => 3,
            Verdict::Fail => 4,
        }
    }
}

/// One of DCGM's warnings on a result, by number (`dcgm_errors.h`): what
/// (`error_id`, e.g. 58 a memory mismatch), where (`error_category`, e.g.
/// 10 hardware memory) and how grave (`error_severity`: 1 monitor, 2
/// isolate, 4 triage, 5 configuration, 6 reset). 0 where dcgmi gave none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Warning {
    pub id: u32,
    pub category: u32,
    pub severity: u32,
}

/// One test's verdict on one GPU (`gpu` `None`: on no GPU in particular,
/// as DCGM 3.x's software checks that passed, or a test's summary).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TestVerdict {
    /// DCGM's category: `Deployment`, `Hardware`, `Integration`, `Stress`.
    pub category: String,
    /// DCGM's name for the test: `software`, `memory`, `pcie` (4.x);
    /// `Persistence Mode`, `GPU Memory`, `PCIe` (3.x).
    pub name: String,
    pub gpu: Option<u32>,
    pub verdict: Verdict,
    /// DCGM's warnings, joined (or, with none, its information), at most
    /// 512 characters.
    pub detail: Option<String>,
    pub warnings: Vec<Warning>,
}

/// What one `dcgmi diag -j` said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiagReport {
    /// The DCGM version dcgmi reported.
    pub version: Option<String>,
    pub tests: Vec<TestVerdict>,
    /// dcgmi's exit status, when the report came from [`run`].
    pub exit_code: Option<i32>,
}

impl DiagReport {
    /// The verdict of the whole run: a failure if any test failed, else a
    /// warning if any warned, else a pass if any passed; a run in which
    /// nothing passed, warned or failed is [`DcgmError::NothingRun`].
    pub fn overall(&self) -> Result<Verdict, DcgmError> {
        worst(self.tests.iter())
    }

    /// The verdict on one GPU: its own tests' and those on no GPU in
    /// particular, by the rule of [`DiagReport::overall`].
    pub fn for_gpu(&self, gpu: u32) -> Result<Verdict, DcgmError> {
        worst(self.tests.iter().filter(|t| t.gpu.is_none_or(|g| g == gpu)))
    }

    /// dcgmi exited 0, so DCGM found nothing failed: a `"Fail"` in its
    /// JSON is then a warning (how DCGM 3.x writes one).
    fn failures_as_warnings(&mut self) {
        for test in &mut self.tests {
            if test.verdict == Verdict::Fail {
                test.verdict = Verdict::Warn;
            }
        }
    }
}

fn worst<'a>(tests: impl Iterator<Item = &'a TestVerdict>) -> Result<Verdict, DcgmError> {
    tests
        .map(|t| t.verdict)
        .filter(|v| v.rank() >= Verdict::Pass.rank())
        .max_by_key(|v| v.rank())
        .ok_or(DcgmError::NothingRun)
}

#[derive(Debug, thiserror::Error)]
pub enum DcgmError {
    #[error("no dcgmi at {}", path.display())]
    NotFound { path: PathBuf },
    #[error("starting {}: {source}", path.display())]
    Spawn {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("reading dcgmi's output: {0}")]
    Io(std::io::Error),
    #[error("dcgmi did not finish within {after:?} and was killed")]
    TimedOut { after: Duration },
    #[error("dcgmi failed ({}) without a report: {excerpt}", exit_text(*code))]
    Failed {
        /// The exit status; `None` when a signal ended it.
        code: Option<i32>,
        /// The start of its stderr, or of its stdout where stderr was empty
        /// (dcgmi writes why it could not reach a host engine to stdout).
        excerpt: String,
    },
    #[error("dcgmi could not run the diagnostic ({}): {message}", exit_text(*code))]
    Runtime {
        message: String,
        version: Option<String>,
        code: Option<i32>,
    },
    #[error("dcgmi printed no JSON")]
    NoJson,
    #[error("dcgmi's JSON: {0}")]
    BadJson(String),
    #[error("dcgmi printed more than {limit} bytes")]
    TooLarge { limit: usize },
    #[error("dcgmi ran no test")]
    NothingRun,
    #[error("{0}")]
    InvalidRequest(String),
}

fn exit_text(code: Option<i32>) -> String {
    match code {
        Some(code) => format!("exit status {code}"),
        None => "killed by a signal".to_owned(),
    }
}

/// The arguments of a diagnostic run on `gpus` (indices, as NVML and
/// DCGM number them), at `level`, with JSON output, through the host engine
/// at `host` (`dcgmi`'s default, `localhost`, when `None`).
pub fn diag_args(level: Level, gpus: &[u32], host: Option<&str>) -> Result<Vec<String>, DcgmError> {
    if gpus.is_empty() {
        // Without -i, DCGM 4.x takes every GPU and CPU.
        return Err(DcgmError::InvalidRequest(
            "a DCGM diagnostic needs at least one GPU".to_owned(),
        ));
    }
    let list = gpus
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let mut args = ["diag", "-r", level.run_arg(), "-j", "-i"]
        .map(str::to_owned)
        .to_vec();
    args.push(list);
    if let Some(host) = host {
        if host.is_empty()
            || host.starts_with('-')
            || host.chars().any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(DcgmError::InvalidRequest(format!(
                "{host:?} is not a host engine address"
            )));
        }
        args.extend(["--host".to_owned(), host.to_owned()]);
    }
    Ok(args)
}

/// Runs `dcgmi` with `args` and reads its report; a dcgmi still running
/// after `timeout` is killed (SIGKILL) and reaped.
pub async fn run(
    dcgmi: &Path,
    args: &[impl AsRef<OsStr>],
    timeout: Duration,
) -> Result<DiagReport, DcgmError> {
    let mut command = tokio::process::Command::new(dcgmi);
    command
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
    let mut child = command.spawn().map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            DcgmError::NotFound {
                path: dcgmi.to_owned(),
            }
        } else {
            DcgmError::Spawn {
                path: dcgmi.to_owned(),
                source,
            }
        }
    })?;
    let no_pipe = || DcgmError::Io(std::io::Error::other("no pipe from dcgmi"));
    let stdout = child.stdout.take().ok_or_else(no_pipe)?;
    let stderr = child.stderr.take().ok_or_else(no_pipe)?;
    let finished = tokio::time::timeout(timeout, async {
        tokio::try_join!(
            read_capped(stdout, MAX_OUTPUT, true),
            read_capped(stderr, MAX_STDERR, false),
            async { child.wait().await.map_err(DcgmError::Io) },
        )
    })
    .await;
    match finished {
        Ok(Ok((stdout, stderr, status))) => judge(&stdout, &stderr, status),
        Ok(Err(e)) => {
            kill(&mut child).await;
            Err(e)
        }
        Err(_) => {
            kill(&mut child).await;
            Err(DcgmError::TimedOut { after: timeout })
        }
    }
}

async fn kill(child: &mut tokio::process::Child) {
    // Already gone is fine; one that will not die is left to tokio's reaper.
    let _ = child.start_kill();
    let _ = tokio::time::timeout(REAP_GRACE, child.wait()).await;
}

/// Reads to the end, keeping at most `cap` bytes: more is an error when
/// `overflow_is_error`, else dropped.
async fn read_capped(
    mut reader: impl AsyncRead + Unpin,
    cap: usize,
    overflow_is_error: bool,
) -> Result<Vec<u8>, DcgmError> {
    let mut kept = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let n = reader.read(&mut buf).await.map_err(DcgmError::Io)?;
        if n == 0 {
            return Ok(kept);
        }
        let room = cap - kept.len();
        if n > room && overflow_is_error {
            return Err(DcgmError::TooLarge { limit: cap });
        }
        kept.extend_from_slice(&buf[..n.min(room)]);
    }
}

fn judge(stdout: &[u8], stderr: &[u8], status: ExitStatus) -> Result<DiagReport, DcgmError> {
    let code = status.code();
    match parse(stdout) {
        Ok(mut report) => {
            if status.success() {
                report.failures_as_warnings();
            }
            report.exit_code = code;
            Ok(report)
        }
        Err(DcgmError::Runtime {
            message, version, ..
        }) => Err(DcgmError::Runtime {
            message,
            version,
            code,
        }),
        Err(DcgmError::NoJson) if !status.success() => {
            let said = if stderr.iter().all(u8::is_ascii_whitespace) {
                stdout
            } else {
                stderr
            };
            Err(DcgmError::Failed {
                code,
                excerpt: bounded(String::from_utf8_lossy(said).trim(), MAX_EXCERPT),
            })
        }
        Err(e) => Err(e),
    }
}

/// Reads dcgmi's output: the first JSON object in it (dcgmi may print a
/// line of text before it; whatever follows it is ignored).
pub fn parse(output: &[u8]) -> Result<DiagReport, DcgmError> {
    if output.len() > MAX_OUTPUT {
        return Err(DcgmError::TooLarge { limit: MAX_OUTPUT });
    }
    let start = output
        .iter()
        .position(|&b| b == b'{')
        .ok_or(DcgmError::NoJson)?;
    let raw: RawOutput = serde_json::Deserializer::from_slice(&output[start..])
        .into_iter()
        .next()
        .ok_or(DcgmError::NoJson)?
        .map_err(|e| DcgmError::BadJson(e.to_string()))?;
    let RawOutput {
        v4,
        v3,
        metadata,
        version: top_version,
    } = raw;
    let diag = v4.or(v3).ok_or_else(|| {
        DcgmError::BadJson("neither \"DCGM Diagnostic\" nor \"DCGM GPU Diagnostic\"".to_owned())
    })?;
    let version = metadata
        .and_then(|m| m.version)
        .or(top_version)
        .or(diag.version);
    if let Some(message) = diag.runtime_error {
        return Err(DcgmError::Runtime {
            message,
            version,
            code: None,
        });
    }
    let mut tests = Vec::new();
    for category in items(diag.test_categories) {
        for test in items(category.tests) {
            read_test(&category.category, test, &mut tests)?;
        }
    }
    Ok(DiagReport {
        version,
        tests,
        exit_code: None,
    })
}

fn read_test(category: &str, test: RawTest, out: &mut Vec<TestVerdict>) -> Result<(), DcgmError> {
    let mut worst: Option<Verdict> = None;
    for result in items(test.results) {
        let verdict = verdict_of(category, &test.name, result)?;
        if worst.is_none_or(|w| verdict.verdict.rank() > w.rank()) {
            worst = Some(verdict.verdict);
        }
        out.push(verdict);
    }
    match test.test_summary {
        // The summary also holds what no entity's result does: keep it
        // where it is worse than every entity's.
        Some(summary) => {
            let mut summary = verdict_of(category, &test.name, summary)?;
            summary.gpu = None;
            if worst.is_none_or(|w| summary.verdict.rank() > w.rank()) {
                out.push(summary);
            }
        }
        None if worst.is_none() => out.push(TestVerdict {
            category: category.to_owned(),
            name: test.name,
            gpu: None,
            verdict: Verdict::NotRun,
            detail: None,
            warnings: Vec::new(),
        }),
        None => {}
    }
    Ok(())
}

fn verdict_of(category: &str, name: &str, result: RawResult) -> Result<TestVerdict, DcgmError> {
    let status = result
        .status
        .ok_or_else(|| DcgmError::BadJson(format!("a result of {name} without a status")))?;
    let verdict = Verdict::from_status(&status)
        .ok_or_else(|| DcgmError::BadJson(format!("{name}: unknown status {status:?}")))?;
    let is_gpu = result.entity_group_id == Some(ENTITY_GROUP_GPU)
        || result.entity_group.as_deref() == Some("GPU");
    let gpu = match (is_gpu, result.entity_id, result.gpu_id) {
        (true, Some(id), _) => Some(id),
        (_, None, Some(RawId::Number(id))) => Some(id),
        (_, None, Some(RawId::Text(id))) => Some(id.trim().parse().map_err(|_| {
            DcgmError::BadJson(format!("{name}: gpu_id {id:?} is not a GPU index"))
        })?),
        _ => None,
    };
    let mut texts = Vec::new();
    let mut warnings = Vec::new();
    for w in items(result.warnings) {
        if let Some(text) = w.warning.or(w.warnings) {
            texts.push(text);
        }
        warnings.push(Warning {
            id: w.error_id,
            category: w.error_category,
            severity: w.error_severity,
        });
    }
    if texts.is_empty() {
        texts = match result.info {
            Some(RawInfo::One(info)) => vec![info],
            Some(RawInfo::Many(info)) => info.into_iter().flatten().collect(),
            None => Vec::new(),
        };
    }
    let texts: Vec<&str> = texts
        .iter()
        .map(|t| t.trim())
        .filter(|t| !t.is_empty())
        .collect();
    let detail = (!texts.is_empty()).then(|| bounded(&texts.join("; "), MAX_DETAIL));
    Ok(TestVerdict {
        category: category.to_owned(),
        name: name.to_owned(),
        gpu,
        verdict,
        detail,
        warnings,
    })
}

/// `text`, cut to at most `max` characters (an ellipsis marking the cut).
fn bounded(text: &str, max: usize) -> String {
    match text.char_indices().nth(max) {
        None => text.to_owned(),
        Some(_) => {
            let cut: String = text.chars().take(max.saturating_sub(1)).collect();
            cut + "…"
        }
    }
}

/// The non-null entries of an array that may be absent or null (jsoncpp,
/// which dcgmi writes with, leaves nulls where an index was skipped).
fn items<T>(list: Option<Vec<Option<T>>>) -> impl Iterator<Item = T> {
    list.into_iter().flatten().flatten()
}

// dcgmi's JSON, as far as the agent reads it; every other key is ignored.

#[derive(Deserialize)]
struct RawOutput {
    #[serde(rename = "DCGM Diagnostic")]
    v4: Option<RawDiag>,
    #[serde(rename = "DCGM GPU Diagnostic")]
    v3: Option<RawDiag>,
    metadata: Option<RawMetadata>,
    version: Option<String>,
}

#[derive(Deserialize)]
struct RawMetadata {
    version: Option<String>,
}

#[derive(Deserialize)]
struct RawDiag {
    test_categories: Option<Vec<Option<RawCategory>>>,
    runtime_error: Option<String>,
    version: Option<String>,
}

#[derive(Deserialize)]
struct RawCategory {
    category: String,
    tests: Option<Vec<Option<RawTest>>>,
}

#[derive(Deserialize)]
struct RawTest {
    name: String,
    results: Option<Vec<Option<RawResult>>>,
    test_summary: Option<RawResult>,
}

#[derive(Deserialize)]
struct RawResult {
    entity_group: Option<String>,
    entity_group_id: Option<u32>,
    entity_id: Option<u32>,
    gpu_id: Option<RawId>,
    status: Option<String>,
    warnings: Option<Vec<Option<RawWarning>>>,
    info: Option<RawInfo>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawId {
    Number(u32),
    Text(String),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RawInfo {
    One(String),
    Many(Vec<Option<String>>),
}

#[derive(Deserialize)]
struct RawWarning {
    warning: Option<String>,
    /// DCGM 3.x's software checks put the text here.
    warnings: Option<String>,
    #[serde(default)]
    error_id: u32,
    #[serde(default)]
    error_category: u32,
    #[serde(default)]
    error_severity: u32,
}

#[cfg(test)]
mod tests;
