//! The agent's record of the requests it has begun and finished, on the
//! node's disk: each request id is carried out at most once, even when the
//! agent restarts between carrying it out and writing its result.

use std::{
    fs,
    path::{Path, PathBuf},
};

use gpuhealth_api::contract::{Outcome, RequestResult};
use serde::{Deserialize, Serialize};

use crate::state_file::{self, StateFileError};

/// How many requests the journal remembers; ids are unique per attempt, so
/// older ones never come back.
const KEEP: usize = 100;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Entry {
    id: String,
    /// Absent while the request is being carried out (or if the agent died doing so).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    result: Option<RequestResult>,
}

/// What the journal says about a request id.
#[derive(Clone, Debug, PartialEq)]
pub enum Seen {
    New,
    /// Begun but never finished: the agent stopped while carrying it out.
    Interrupted,
    Finished(RequestResult),
}

#[derive(Debug, thiserror::Error)]
#[error("the request journal {path}: {source}")]
pub struct JournalError {
    path: PathBuf,
    source: std::io::Error,
}

impl From<StateFileError> for JournalError {
    fn from(e: StateFileError) -> JournalError {
        JournalError {
            path: e.path,
            source: e.source,
        }
    }
}

pub struct Journal {
    path: PathBuf,
    entries: Vec<Entry>,
}

impl Journal {
    /// Opens the journal in `dir`, creating it if needed. A journal that
    /// cannot be read is an error, never an empty one: that could repeat a
    /// reset.
    pub fn open(dir: &Path) -> Result<Journal, JournalError> {
        let path = dir.join("requests.json");
        let err = |source| JournalError {
            path: path.clone(),
            source,
        };
        fs::create_dir_all(dir).map_err(err)?;
        let entries = state_file::read(&path)?.unwrap_or_default();
        Ok(Journal { path, entries })
    }

    pub fn seen(&self, id: &str) -> Seen {
        match self.entries.iter().find(|e| e.id == id) {
            None => Seen::New,
            Some(Entry { result: None, .. }) => Seen::Interrupted,
            Some(Entry {
                result: Some(r), ..
            }) => Seen::Finished(r.clone()),
        }
    }

    /// Records that `id` is about to be carried out; on disk before it is.
    pub fn begin(&mut self, id: &str) -> Result<(), JournalError> {
        self.entries.retain(|e| e.id != id);
        self.entries.push(Entry {
            id: id.to_owned(),
            result: None,
        });
        let over = self.entries.len().saturating_sub(KEEP);
        self.entries.drain(..over);
        self.save()
    }

    pub fn finish(&mut self, result: &RequestResult) -> Result<(), JournalError> {
        let id = result.id.to_string();
        match self.entries.iter_mut().find(|e| e.id == id) {
            Some(e) => e.result = Some(result.clone()),
            None => self.entries.push(Entry {
                id,
                result: Some(result.clone()),
            }),
        }
        self.save()
    }

    /// Written to a temporary file, synced, then renamed over the journal:
    /// a crash leaves the old journal or the new one, never half of one.
    fn save(&self) -> Result<(), JournalError> {
        Ok(state_file::replace(&self.path, &self.entries, true)?)
    }
}

/// The result to write for a request the agent stopped in the middle of:
/// not repeated, since it may have happened.
pub fn interrupted(
    id: &gpuhealth_api::contract::RequestId,
    now: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time,
) -> RequestResult {
    RequestResult {
        id: id.clone(),
        outcome: Outcome::Failed,
        message: "the agent restarted while carrying this out; it was not repeated: its outcome is unknown, so read the GPUs' health again".into(),
        finished_at: now,
        diagnostics: None,
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};

    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("gpuhealth-journal-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    fn result(id: &str) -> RequestResult {
        RequestResult {
            id: id.parse().expect("id"),
            outcome: Outcome::Succeeded,
            message: "done".into(),
            finished_at: Time(Timestamp::UNIX_EPOCH),
            diagnostics: None,
        }
    }

    #[test]
    fn what_was_begun_and_finished_survives_a_restart() {
        let d = dir("restart");
        let mut j = Journal::open(&d).expect("open");
        assert_eq!(j.seen("inc-1-reset-1"), Seen::New);
        j.begin("inc-1-reset-1").expect("begin");
        j.begin("inc-1-reset-2").expect("begin");
        j.finish(&result("inc-1-reset-2")).expect("finish");
        let j = Journal::open(&d).expect("reopen");
        assert_eq!(j.seen("inc-1-reset-1"), Seen::Interrupted);
        assert_eq!(
            j.seen("inc-1-reset-2"),
            Seen::Finished(result("inc-1-reset-2"))
        );
        assert_eq!(j.seen("inc-2-reset-1"), Seen::New);
    }

    #[test]
    fn a_diagnostics_answer_is_kept_whole() {
        use gpuhealth_api::contract::{
            DiagnosticTest, DiagnosticsLevel, DiagnosticsResult, DiagnosticsVerdict, TestVerdict,
        };
        let d = dir("diagnostics");
        let mut answer = result("inc-1-reset-1-diagnostics");
        answer.outcome = Outcome::Failed;
        answer.diagnostics = Some(DiagnosticsResult {
            level: DiagnosticsLevel::Medium,
            verdict: DiagnosticsVerdict::Fail,
            dcgm_version: Some("4.2.3".into()),
            tests: vec![DiagnosticTest {
                name: "memory".into(),
                gpu: Some("GPU-0a1b2c3d".into()),
                verdict: TestVerdict::Fail,
                detail: Some("read back differs".into()),
            }],
        });
        let mut j = Journal::open(&d).expect("open");
        j.begin("inc-1-reset-1-diagnostics").expect("begin");
        j.finish(&answer).expect("finish");
        // A restarted executor writes the same answer again.
        let j = Journal::open(&d).expect("reopen");
        assert_eq!(j.seen("inc-1-reset-1-diagnostics"), Seen::Finished(answer));
    }

    #[test]
    fn it_keeps_the_latest_hundred() {
        let d = dir("bounded");
        let mut j = Journal::open(&d).expect("open");
        for i in 0..150 {
            j.begin(&format!("inc-{i}-reset-1")).expect("begin");
        }
        assert_eq!(j.seen("inc-0-reset-1"), Seen::New);
        assert_eq!(j.seen("inc-149-reset-1"), Seen::Interrupted);
        assert_eq!(j.entries.len(), KEEP);
    }

    #[test]
    fn an_unreadable_journal_is_an_error_not_an_empty_one() {
        let d = dir("corrupt");
        fs::create_dir_all(&d).expect("dir");
        fs::write(d.join("requests.json"), b"{not json").expect("write");
        let e = Journal::open(&d).err().expect("an error");
        assert!(e.to_string().contains("requests.json"), "{e}");
    }
}
