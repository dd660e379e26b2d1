//! What the kernel log has said about each GPU so far: its UUID, its Xids
//! (one seen in the log and through NVML's events kept once) and the
//! recovery action its last Xid 154 announced, within fixed bounds whatever
//! the log holds. Its health is judged in [`crate::judgement`].
//!
//! While NVML's own Xid events are up, an Xid the kernel log alone shows is
//! not believed until NVML's event for it comes: the kernel log also
//! carries lines whose words a tenant's process chose (see
//! `parse::parse_line`), and the driver tells NVML of each Xid itself.

use std::collections::{BTreeMap, BTreeSet};

use gpuhealth_api::contract::{GpuEntry, PodRef, XidEvent};
use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::{SignedDuration, Timestamp},
};

use super::parse::{KernelEvent, PciAddress, XidLine, parse_line};
use crate::judgement;

/// How many Xids per GPU the report carries (newest kept).
pub const XIDS_PER_GPU: usize = 16;

/// How many GPUs the kernel log may describe: a GPU report carries at
/// most 64, and a log that names more (corrupt, or hostile) must not grow
/// the agent without bound. Lines about further PCI addresses are ignored.
pub const GPUS_TRACKED: usize = 64;

/// The same Xid on the same GPU from the same source within this many
/// seconds is one event seen twice.
const DUPLICATE_WINDOW_SECS: i64 = 2;

/// How far apart the kernel log's line and NVML's event for one Xid may
/// be: they are read apart (the log's reader, NVML's thread), and a line
/// is stamped with when it was logged, an event with when it came.
pub const CORROBORATION_WINDOW: SignedDuration = SignedDuration::from_secs(10);

/// How soon after an Xid the GPU's holder then is taken to be whose it
/// was: an Xid replayed from before the agent started, or read late, is
/// nobody's.
const ATTRIBUTION_WINDOW: SignedDuration = SignedDuration::from_secs(60);

/// What NVML says in place of a line's text.
const FROM_NVML: &str = "reported by NVML";

/// One Xid, and who has told of it.
#[derive(Debug)]
struct Told {
    xid: XidEvent,
    in_log: bool,
    by_nvml: bool,
    /// Logged while NVML's events were up: believed once NVML says so too.
    awaits_nvml: bool,
    /// Whether its pod has been looked for (once, while it is fresh).
    attributed: bool,
}

/// Where a new Xid came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    KernelLog,
    Nvml,
}

/// What the kernel log has said about each GPU so far.
#[derive(Debug, Default)]
pub struct KernelLog {
    uuids: BTreeMap<PciAddress, String>,
    xids: BTreeMap<PciAddress, Vec<Told>>,
    /// The newest recovery action an Xid 154 announced, per GPU.
    recovery: BTreeMap<PciAddress, u32>,
    /// Since when NVML's Xid events have been up, while they are.
    nvml_listening_since: Option<Timestamp>,
}

impl KernelLog {
    /// Takes in one line, stamped `at` (when it was logged, if known), and
    /// returns its Xid code if it is a new Xid line.
    pub fn take(&mut self, line: &str, at: Timestamp) -> Option<u32> {
        match parse_line(line) {
            Some(KernelEvent::GpuAt { pci, uuid }) if self.tracks(&pci) => {
                self.uuids.insert(pci, uuid);
                None
            }
            Some(KernelEvent::Xid(x)) if self.tracks(&x.pci) => {
                if let Some(action) = x.recovery_action {
                    self.recovery.insert(x.pci, action);
                }
                let code = x.code;
                self.add(x.pci, line_event(x, at), Source::KernelLog)
                    .then_some(code)
            }
            Some(_) | None => None,
        }
    }

    /// An Xid from NVML's event set, for the GPU at `pci`, come `at`; true
    /// when it was not known yet.
    pub fn nvml_xid(&mut self, pci: PciAddress, code: u32, at: Timestamp) -> bool {
        self.add(pci, XidEvent::new(code, Time(at), FROM_NVML), Source::Nvml)
    }

    /// NVML's Xid events are up from `at` (`Some`), or no longer (`None`:
    /// NVML let go for a reset, or could not register).
    pub fn nvml_listening(&mut self, at: Option<Timestamp>) {
        self.nvml_listening_since = at;
    }

    /// Records an Xid, or what a second source says of one known: false
    /// when it was known already.
    fn add(&mut self, pci: PciAddress, xid: XidEvent, source: Source) -> bool {
        if !self.tracks(&pci) {
            return false;
        }
        let awaits_nvml =
            source == Source::KernelLog && self.nvml_listening_since.is_some_and(|s| s <= xid.at.0);
        let list = self.xids.entry(pci).or_default();
        let near = |t: &Told, window: SignedDuration| {
            t.xid.code == xid.code && (t.xid.at.0.duration_since(xid.at.0)).abs() <= window
        };
        // The other source's word for an Xid already told.
        let untold_by_this = list.iter_mut().rev().take(8).find(|t| {
            near(t, CORROBORATION_WINDOW)
                && match source {
                    Source::KernelLog => !t.in_log,
                    Source::Nvml => !t.by_nvml,
                }
        });
        if let Some(told) = untold_by_this {
            match source {
                Source::KernelLog => {
                    // The line says more than the event: when it was
                    // logged, its text, its process.
                    told.in_log = true;
                    let pod = told.xid.pod.take();
                    told.xid = XidEvent { pod, ..xid };
                }
                Source::Nvml => told.by_nvml = true,
            }
            return false;
        }
        let repeat = list
            .iter()
            .rev()
            .take(4)
            .any(|t| near(t, SignedDuration::from_secs(DUPLICATE_WINDOW_SECS)));
        if repeat {
            return false;
        }
        list.push(Told {
            xid,
            in_log: source == Source::KernelLog,
            by_nvml: source == Source::Nvml,
            awaits_nvml,
            attributed: false,
        });
        let over = list.len().saturating_sub(XIDS_PER_GPU);
        list.drain(..over);
        true
    }

    /// Names the pod whose Xids they are, for the Xids of the GPU at `pci`
    /// not looked at yet: where one pod holds it now (`holders`) and the
    /// Xid is fresh, that pod; otherwise nobody (several pods share the
    /// GPU, or the holder then may have gone). Each Xid is looked at once.
    pub fn attribute(&mut self, pci: &PciAddress, holders: &[PodRef], now: Timestamp) {
        let Some(list) = self.xids.get_mut(pci) else {
            return;
        };
        for told in list.iter_mut().filter(|t| !t.attributed) {
            told.attributed = true;
            if let [holder] = holders
                && now.duration_since(told.xid.at.0) <= ATTRIBUTION_WINDOW
            {
                told.xid.pod = Some(holder.clone());
            }
        }
    }

    /// Whether lines about `pci` are taken in: a GPU already known, or room
    /// for one more.
    fn tracks(&self, pci: &PciAddress) -> bool {
        let known = self.uuids.contains_key(pci)
            || self.xids.contains_key(pci)
            || self.recovery.contains_key(pci);
        known || self.gpus_known() < GPUS_TRACKED
    }

    fn gpus_known(&self) -> usize {
        let mut all: BTreeSet<&PciAddress> = self.uuids.keys().collect();
        all.extend(self.xids.keys());
        all.extend(self.recovery.keys());
        all.len()
    }

    /// The Xids of the GPU at `pci` as they stand `now`, oldest first: one
    /// that awaits NVML's word is left out until it comes, and reported
    /// `uncorroborated` once [`CORROBORATION_WINDOW`] has passed without it;
    /// NVML's recovery-action field asking for a recovery of the GPU
    /// (`nvml_asks_recovery`) is its word too.
    pub fn xids(
        &self,
        pci: &PciAddress,
        now: Timestamp,
        nvml_asks_recovery: bool,
    ) -> Vec<XidEvent> {
        let Some(list) = self.xids.get(pci) else {
            return Vec::new();
        };
        list.iter()
            .filter_map(|t| {
                if !t.awaits_nvml || t.by_nvml || nvml_asks_recovery {
                    return Some(t.xid.clone());
                }
                let late = now.duration_since(t.xid.at.0) >= CORROBORATION_WINDOW;
                late.then(|| XidEvent {
                    uncorroborated: true,
                    ..t.xid.clone()
                })
            })
            .collect()
    }

    /// The GPUs as the log alone describes them: for a node where NVML
    /// cannot be loaded. A GPU whose UUID the driver never logged cannot be
    /// named, and is left out.
    pub fn entries(&self, now: Timestamp) -> Vec<GpuEntry> {
        // In PCI order (the map's), which is how the driver numbers them.
        self.uuids
            .iter()
            .enumerate()
            .map(|(index, (pci, uuid))| {
                let xids = self.xids(pci, now, false);
                let recovery_action = self.recovery.get(pci).copied();
                GpuEntry {
                    index: index as u32,
                    uuid: uuid.clone(),
                    pci_bus_id: format!("{:08X}:{:02X}:{:02X}.0", pci.domain, pci.bus, pci.device),
                    product: None,
                    health: judgement::of_xids(&xids, recovery_action),
                    xids,
                    recovery_action,
                    remapped_rows: None,
                    pods: Vec::new(),
                    pods_unknown: Some("the kernel log alone does not say who holds it".into()),
                    offered: None,
                }
            })
            .collect()
    }
}

/// An Xid as its line tells it, stamped `at`.
fn line_event(x: XidLine, at: Timestamp) -> XidEvent {
    XidEvent {
        pid: x.pid,
        process: x.process.map(|p| p.chars().take(64).collect()),
        ..XidEvent::new(
            x.code,
            Time(at),
            x.text.chars().take(256).collect::<String>(),
        )
    }
}

#[cfg(test)]
mod tests {
    use gpuhealth_api::GpuHealth;

    use super::*;

    #[test]
    fn the_log_alone_describes_the_incident_gpu() {
        let mut log = KernelLog::default();
        let at = Timestamp::UNIX_EPOCH;
        for line in [
            "NVRM: GPU at PCI:0000:e1:00: GPU-0a1b2c3d-0000-4000-8000-000000000007",
            "NVRM: GPU at PCI:0000:01:00: GPU-0a1b2c3d-0000-4000-8000-000000000000",
            "NVRM: Xid (PCI:0000:e1:00): 119, Timeout after 45s of waiting for RPC response from GPU GSP",
            "NVRM: Xid (PCI:0000:e1:00): 154, GPU recovery action changed from None to GPU Reset Required",
            "NVRM: Xid (PCI:0000:01:00): 13, pid=1, name=python3, Graphics Exception",
            "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
        ] {
            log.take(line, at);
        }
        let gpus = log.entries(at);
        assert_eq!(gpus.len(), 2, "the GPU the driver never named is left out");
        let (first, incident) = (&gpus[0], &gpus[1]);
        assert_eq!(first.pci_bus_id, "00000000:01:00.0");
        assert_eq!(
            first.health,
            GpuHealth::Healthy,
            "an app fault is the app's"
        );
        assert_eq!(incident.uuid, "GPU-0a1b2c3d-0000-4000-8000-000000000007");
        assert_eq!(incident.health, GpuHealth::ResetRequired);
        assert_eq!(incident.recovery_action, Some(1));
        assert_eq!(
            incident.xids.iter().map(|x| x.code).collect::<Vec<_>>(),
            [119, 154]
        );
    }

    fn at(second: i64) -> Timestamp {
        Timestamp::from_second(second).expect("time")
    }

    const E1: &str = "0000:e1:00";

    fn e1() -> PciAddress {
        PciAddress::parse(E1).expect("pci")
    }

    fn codes(log: &KernelLog, now: i64) -> Vec<(u32, bool)> {
        log.xids(&e1(), at(now), false)
            .iter()
            .map(|x| (x.code, x.uncorroborated))
            .collect()
    }

    #[test]
    fn while_nvml_listens_a_logged_xid_waits_for_its_word() {
        let mut log = KernelLog::default();
        // Logged before NVML's events were up (the ring buffer replayed at
        // start): NVML could not have seen it, and the line stands alone.
        log.take("NVRM: Xid (PCI:0000:e1:00): 48, DBE", at(100));
        log.nvml_listening(Some(at(200)));
        assert_eq!(codes(&log, 300), [(48, false)]);

        // Logged while NVML listens, and NVML tells it too: one Xid, with
        // the line's time, text and process.
        log.take(
            "NVRM: Xid (PCI:0000:e1:00): 119, pid=4242, name=python3, Timeout after 45s",
            at(300),
        );
        assert_eq!(codes(&log, 301), [(48, false)], "awaiting NVML");
        assert!(!log.nvml_xid(e1(), 119, at(302)), "the same Xid");
        assert_eq!(codes(&log, 302), [(48, false), (119, false)]);
        let x = log.xids(&e1(), at(302), false).pop().expect("xid");
        assert_eq!(
            (x.at.0, x.pid, x.process.as_deref()),
            (at(300), Some(4242), Some("python3"))
        );
        assert_eq!(x.text, "Timeout after 45s");

        // NVML first, then the line: the same.
        assert!(log.nvml_xid(e1(), 48, at(400)));
        assert!(
            log.take("NVRM: Xid (PCI:0000:e1:00): 48, DBE again", at(399))
                .is_none()
        );
        assert_eq!(codes(&log, 400).len(), 3);

        // Logged while NVML listens, and NVML never tells it: not in the
        // report for the window, then reported as uncorroborated.
        assert_eq!(
            log.take(
                "NVRM: Xid (PCI:0000:e1:00): 79, GPU has fallen off the bus.",
                at(500)
            ),
            Some(79)
        );
        assert_eq!(codes(&log, 505).len(), 3);
        // NVML's recovery-action field asking for a recovery is its word.
        let asked = log.xids(&e1(), at(505), true);
        assert_eq!(
            asked.last().map(|x| (x.code, x.uncorroborated)),
            Some((79, false))
        );
        assert_eq!(codes(&log, 510).last(), Some(&(79, true)));
        // NVML's event after the window is an Xid of its own.
        assert!(log.nvml_xid(e1(), 79, at(520)));
        assert_eq!(codes(&log, 520)[3..], [(79, true), (79, false)]);

        // While NVML has let go (a reset), the log stands alone again.
        log.nvml_listening(None);
        log.take("NVRM: Xid (PCI:0000:e1:00): 31, MMU Fault", at(600));
        assert_eq!(codes(&log, 600).last(), Some(&(31, false)));
    }

    #[test]
    fn an_xid_is_the_pods_that_alone_held_the_gpu_when_it_came() {
        let pod = |name: &str| PodRef {
            namespace: "tenant".into(),
            name: name.into(),
            container: Some("main".into()),
        };
        let mut log = KernelLog::default();
        log.take(
            "NVRM: Xid (PCI:0000:e1:00): 13, pid=1, name=python3, Graphics Exception",
            at(0),
        );
        log.take(
            "NVRM: Xid (PCI:0000:e1:00): 13, pid=2, name=python3, Graphics Exception",
            at(100),
        );
        // Looked at when one pod holds the GPU: the fresh Xid is its, the
        // one from long before nobody's.
        log.attribute(&e1(), &[pod("a")], at(110));
        // Looked at once: a later holder does not take them over.
        log.attribute(&e1(), &[pod("b")], at(111));
        log.take(
            "NVRM: Xid (PCI:0000:e1:00): 31, pid=3, name=python3, MMU Fault",
            at(120),
        );
        // Two pods share the GPU: whose it is cannot be told.
        log.attribute(&e1(), &[pod("a"), pod("b")], at(121));
        let pods: Vec<Option<String>> = log
            .xids(&e1(), at(130), false)
            .into_iter()
            .map(|x| x.pod.map(|p| p.name))
            .collect();
        assert_eq!(pods, [None, Some("a".into()), None]);
    }

    /// Found reviewing the parser for issue 9: every new PCI address in the
    /// log added an entry for good, so a corrupt or hostile log grew the
    /// agent without bound.
    #[test]
    fn a_kernel_log_naming_endless_gpus_is_bounded() {
        let mut log = KernelLog::default();
        for i in 0..10_000u32 {
            let (bus, dev) = (i % 256, i / 256);
            log.take(
                &format!(
                    "NVRM: GPU at PCI:0000:{bus:02x}:{dev:02x}: GPU-0a1b2c3d-0000-4000-8000-{i:012}"
                ),
                Timestamp::UNIX_EPOCH,
            );
            log.take(
                &format!("NVRM: Xid (PCI:0000:{bus:02x}:{dev:02x}): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)"),
                Timestamp::UNIX_EPOCH,
            );
        }
        let now = Timestamp::UNIX_EPOCH;
        assert_eq!(log.entries(now).len(), GPUS_TRACKED);
        assert_eq!(log.gpus_known(), GPUS_TRACKED);
        // The GPUs it knows still take new lines.
        let first = log.entries(now)[0].clone();
        assert_eq!(
            log.xids(&PciAddress::parse("0000:00:00").expect("pci"), now, false)
                .len(),
            1
        );
        assert!(
            log.take(
                "NVRM: Xid (PCI:0000:00:00): 48, DBE",
                Timestamp::from_second(60).expect("t")
            )
            .is_some()
        );
        assert_eq!(first.uuid, "GPU-0a1b2c3d-0000-4000-8000-000000000000");
    }

    proptest::proptest! {
        #[test]
        fn never_panics_on_arbitrary_bytes(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..300)) {
            let line = String::from_utf8_lossy(&bytes);
            let _ = parse_line(&line);
            let mut log = KernelLog::default();
            log.take(&line, Timestamp::UNIX_EPOCH);
            let _ = log.entries(Timestamp::UNIX_EPOCH);
        }
    }
}
