//! When each GPU last recovered, kept on the node's disk: Xids logged before
//! then are answered, and the kernel log, which replays its ring buffer to
//! each new reader with the Xids' original times, must not make them act
//! again after the agent restarts.
//!
//! A recovery is confirmed by NVML: the executor's own reset, once the GPU
//! reads back with nothing more to do (kept by the executor, see
//! [`crate::handoff`]), or the recovery action the driver asked for going
//! back to 0 (someone else's reset, or the driver's own), which the
//! reporter sees and keeps here.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
};

use gpuhealth_api::contract::XidEvent;
use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};

use crate::state_file::{read, replace};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Gpu {
    /// When it last recovered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    recovered_at: Option<Timestamp>,
    /// The recovery action NVML last read, to see it go back to 0.
    #[serde(default)]
    recovery_action: u32,
}

pub struct Recoveries {
    path: PathBuf,
    gpus: BTreeMap<String, Gpu>,
}

impl Recoveries {
    /// Opens the record in `dir`; where there is none yet, starts from the
    /// one at `seed` (where an agent of one part kept it). One that cannot
    /// be read is an error, not an empty record: that would make answered
    /// Xids act again.
    pub fn open(dir: &Path, seed: Option<&Path>) -> Result<Recoveries, String> {
        let path = dir.join("recoveries.json");
        fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let gpus = match read(&path)? {
            Some(gpus) => gpus,
            None => match seed {
                Some(seed) => read(&seed.join("recoveries.json"))?.unwrap_or_default(),
                None => BTreeMap::new(),
            },
        };
        Ok(Recoveries { path, gpus })
    }

    /// The executor reset a GPU at `at` and read it back recovered: its
    /// recovery action is 0 from then (so reading 0 next is no new
    /// recovery, which would answer Xids logged since). A reset already
    /// known changes nothing.
    pub fn reset(&mut self, uuid: &str, at: Timestamp) -> Result<(), String> {
        let gpu = self.gpus.entry(uuid.to_owned()).or_default();
        if gpu.recovered_at.is_some_and(|r| r >= at) {
            return Ok(());
        }
        gpu.recovered_at = Some(at);
        gpu.recovery_action = 0;
        self.save()
    }

    /// What NVML read of a GPU's recovery action: going back to 0 from
    /// anything else is a recovery.
    pub fn observe(&mut self, uuid: &str, action: u32, at: Timestamp) -> Result<(), String> {
        let gpu = self.gpus.entry(uuid.to_owned()).or_default();
        if gpu.recovery_action == action {
            return Ok(());
        }
        if action == 0 {
            gpu.recovered_at = Some(at);
        }
        gpu.recovery_action = action;
        self.save()
    }

    /// The Xids that still count: those after the GPU's last recovery.
    pub fn fresh(&self, uuid: &str, xids: &[XidEvent]) -> Vec<XidEvent> {
        let since = self.gpus.get(uuid).and_then(|g| g.recovered_at);
        xids.iter()
            .filter(|x| since.is_none_or(|s| x.at.0 > s))
            .cloned()
            .collect()
    }

    fn save(&self) -> Result<(), String> {
        Ok(replace(&self.path, &self.gpus, true)?)
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;

    fn xid(code: u32, second: i64) -> XidEvent {
        XidEvent::new(
            code,
            Time(Timestamp::from_second(second).expect("time")),
            "",
        )
    }

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "gpuhealth-recoveries-{name}-{}",
            std::process::id()
        ));
        let _ = fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn xids_before_a_recovery_stay_answered_across_a_restart() {
        let d = dir("restart");
        let mut r = Recoveries::open(&d, None).expect("open");
        let xids = [xid(119, 1_000), xid(154, 1_001)];
        assert_eq!(r.fresh("GPU-a", &xids), xids);
        r.observe("GPU-a", 1, Timestamp::from_second(1_002).expect("t"))
            .expect("observe");
        r.reset("GPU-a", Timestamp::from_second(1_005).expect("t"))
            .expect("record");
        // Read 0 after the reset: no new recovery, Xids since still count.
        r.observe("GPU-a", 0, Timestamp::from_second(1_010).expect("t"))
            .expect("observe");
        assert_eq!(r.fresh("GPU-a", &[xid(13, 1_007)]).len(), 1);
        let r = Recoveries::open(&d, None).expect("reopen");
        assert_eq!(r.fresh("GPU-a", &xids), []);
        let later = [xids[0].clone(), xid(119, 2_000)];
        assert_eq!(r.fresh("GPU-a", &later), [xid(119, 2_000)]);
        // Another GPU's recovery answers nothing of this one's.
        assert_eq!(r.fresh("GPU-b", &xids), xids);
    }

    #[test]
    fn the_recovery_action_going_back_to_zero_is_a_recovery() {
        let d = dir("action");
        let mut r = Recoveries::open(&d, None).expect("open");
        let t = |s| Timestamp::from_second(s).expect("t");
        // 0 from the start is no recovery: nothing was asked.
        r.observe("GPU-a", 0, t(900)).expect("observe");
        assert_eq!(r.fresh("GPU-a", &[xid(48, 950)]), [xid(48, 950)]);
        r.observe("GPU-a", 1, t(1_000)).expect("observe");
        assert_eq!(r.fresh("GPU-a", &[xid(119, 990)]).len(), 1);
        r.observe("GPU-a", 0, t(1_100)).expect("observe");
        assert_eq!(r.fresh("GPU-a", &[xid(119, 990)]), []);
    }

    #[test]
    fn an_unreadable_record_is_an_error() {
        let d = dir("corrupt");
        fs::create_dir_all(&d).expect("dir");
        fs::write(d.join("recoveries.json"), b"[").expect("write");
        let e = Recoveries::open(&d, None).err().expect("an error");
        assert!(e.contains("recoveries.json"), "{e}");
        let e = Recoveries::open(&dir("seeded"), Some(&d))
            .err()
            .expect("an error");
        assert!(e.contains("recoveries.json"), "{e}");
    }

    #[test]
    fn a_record_kept_where_the_one_part_agent_kept_it_is_carried_over() {
        let old = dir("old");
        let mut r = Recoveries::open(&old, None).expect("open");
        r.reset("GPU-a", Timestamp::from_second(1_005).expect("t"))
            .expect("record");
        let new = dir("new");
        let r = Recoveries::open(&new, Some(&old)).expect("seeded");
        assert_eq!(r.fresh("GPU-a", &[xid(119, 1_000)]), []);
    }
}
