//! What the executor tells the reporter, through files in the executor's
//! state directory (a hostPath the reporter mounts read-only: it can read
//! them and write nothing the executor reads, so a compromised reporter
//! cannot steer the more privileged part through them):
//!
//! - `offer.json`: what the executor checked it can carry out (nvidia-smi
//!   runs, the reboot method works), good until a time it sets; the report
//!   offers nothing once that has passed (the executor is gone or stuck).
//! - `let-go.json`: a reset is about to start; the reporter lets go of
//!   NVML (which holds every GPU open) until the file is gone or its time
//!   has passed, and publishes nothing meanwhile.
//! - `resets.json`: when the executor last reset each GPU, so that Xids
//!   logged before it are answered.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    time::Duration,
};

use gpuhealth_api::contract::{Capabilities, RebootMethod};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use serde::{Deserialize, Serialize};

use crate::state_file::{read, replace};

/// How long an offer stands when the executor renews it each pass.
pub const OFFER_STANDS: Duration = Duration::from_secs(120);
/// How often the executor renews an unchanged offer.
pub const RENEW_OFFER: Duration = Duration::from_secs(30);

/// What the executor can carry out, as it last checked.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Offer {
    /// nvidia-smi runs (a reset also needs NVML answering the reporter).
    pub reset: bool,
    pub reboot: RebootMethod,
    /// Why anything is not offered.
    #[serde(default)]
    pub withheld: Vec<String>,
    /// The offer stands until then.
    pub until: Timestamp,
}

/// A reset under way: the reporter lets go of every GPU until then.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LetGo {
    pub request: String,
    pub until: Timestamp,
}

/// The executor's state directory, as either part sees it.
#[derive(Clone, Debug)]
pub struct Handoff {
    dir: PathBuf,
}

impl Handoff {
    pub fn new(dir: &Path) -> Handoff {
        Handoff {
            dir: dir.to_path_buf(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    // The executor's side.

    /// At the executor's start: a let-go left by its previous life is over.
    pub fn executor_started(&self) -> Result<(), String> {
        self.no_more_let_go()
    }

    fn no_more_let_go(&self) -> Result<(), String> {
        let path = self.path("let-go.json");
        match fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(format!("{}: {e}", path.display()))
            }
            _ => Ok(()),
        }
    }

    pub fn offer(&self, offer: &Offer) -> Result<(), String> {
        Ok(replace(&self.path("offer.json"), offer, false)?)
    }

    pub fn ask_to_let_go(&self, request: &str, for_at_most: Duration) -> Result<(), String> {
        let until = after(for_at_most);
        let letgo = LetGo {
            request: request.to_owned(),
            until,
        };
        Ok(replace(&self.path("let-go.json"), &letgo, true)?)
    }

    pub fn done_with_the_gpus(&self) -> Result<(), String> {
        self.no_more_let_go()
    }

    /// Records that `uuid` was reset and read back recovered at `at`.
    pub fn reset_done(&self, uuid: &str, at: Timestamp) -> Result<(), String> {
        let mut resets = self.resets()?;
        resets.insert(uuid.to_owned(), at);
        Ok(replace(&self.path("resets.json"), &resets, true)?)
    }

    // The reporter's side.

    /// The offer, if one stands now; otherwise why not.
    pub fn standing_offer(&self) -> Result<Offer, String> {
        let path = self.path("offer.json");
        let offer: Offer = read(&path)?
            .ok_or_else(|| format!("the executor has made no offer ({})", path.display()))?;
        if offer.until < Timestamp::now() {
            return Err(format!(
                "the executor's offer ran out at {} (is it running?)",
                offer.until
            ));
        }
        Ok(offer)
    }

    /// What the report offers: a reset only where NVML answers the reporter
    /// too.
    pub fn capabilities(&self, nvml_answers: bool) -> (Capabilities, Vec<String>) {
        match self.standing_offer() {
            Ok(o) => (
                Capabilities {
                    reset: nvml_answers && o.reset,
                    reboot: o.reboot,
                },
                o.withheld,
            ),
            Err(why) => (
                Capabilities {
                    reset: false,
                    reboot: RebootMethod::None,
                },
                vec![why],
            ),
        }
    }

    /// Whether a reset asks the reporter to let go of the GPUs now.
    pub fn asked_to_let_go(&self) -> bool {
        matches!(read::<LetGo>(&self.path("let-go.json")), Ok(Some(l)) if l.until > Timestamp::now())
    }

    /// When the executor last reset each GPU. An unreadable record is an
    /// error: Xids it answered would otherwise act again.
    pub fn resets(&self) -> Result<BTreeMap<String, Timestamp>, String> {
        Ok(read(&self.path("resets.json"))?.unwrap_or_default())
    }
}

/// `now + d`, saturating.
pub fn after(d: Duration) -> Timestamp {
    let d = SignedDuration::try_from(d).unwrap_or(SignedDuration::MAX);
    Timestamp::now().checked_add(d).unwrap_or(Timestamp::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("gpuhealth-handoff-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn an_offer_stands_until_its_time_and_no_longer() {
        let h = Handoff::new(&dir("offer"));
        let (none, why) = h.capabilities(true);
        assert!(!none.reset && none.reboot == RebootMethod::None);
        assert!(why[0].contains("no offer"), "{why:?}");
        let mut offer = Offer {
            reset: true,
            reboot: RebootMethod::Logind,
            withheld: vec![],
            until: after(OFFER_STANDS),
        };
        h.offer(&offer).expect("offer");
        assert_eq!(
            h.capabilities(true).0,
            Capabilities {
                reset: true,
                reboot: RebootMethod::Logind
            }
        );
        assert!(
            !h.capabilities(false).0.reset,
            "no reset where NVML does not answer the reporter"
        );
        offer.until = Timestamp::now() - SignedDuration::from_secs(1);
        h.offer(&offer).expect("offer");
        let (ran_out, why) = h.capabilities(true);
        assert!(!ran_out.reset && ran_out.reboot == RebootMethod::None);
        assert!(why[0].contains("ran out"), "{why:?}");
    }

    #[test]
    fn a_let_go_lasts_until_done_or_its_time_and_not_past_a_restart() {
        let h = Handoff::new(&dir("letgo"));
        assert!(!h.asked_to_let_go());
        h.ask_to_let_go("inc-1-reset-1", Duration::from_secs(60))
            .expect("ask");
        assert!(h.asked_to_let_go());
        h.done_with_the_gpus().expect("done");
        assert!(!h.asked_to_let_go());
        h.ask_to_let_go("inc-1-reset-2", Duration::ZERO)
            .expect("ask");
        assert!(!h.asked_to_let_go(), "its time has passed");
        h.ask_to_let_go("inc-1-reset-3", Duration::from_secs(60))
            .expect("ask");
        h.executor_started().expect("start");
        assert!(
            !h.asked_to_let_go(),
            "an executor that starts again is not resetting"
        );
    }

    #[test]
    fn resets_are_kept_and_an_unreadable_record_is_an_error() {
        let d = dir("resets");
        let h = Handoff::new(&d);
        assert!(h.resets().expect("none yet").is_empty());
        let t = Timestamp::from_second(1_000).expect("t");
        h.reset_done("GPU-a", t).expect("record");
        assert_eq!(h.resets().expect("read").get("GPU-a"), Some(&t));
        fs::write(d.join("resets.json"), b"{").expect("write");
        assert!(h.resets().is_err_and(|e| e.contains("resets.json")));
    }
}
