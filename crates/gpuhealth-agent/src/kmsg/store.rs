//! What the kernel log has said about each GPU so far: its UUID, its Xids
//! (one seen in the log and through NVML's events kept once) and the
//! recovery action its last Xid 154 announced, within fixed bounds whatever
//! the log holds. Its health is judged in [`crate::judgement`].

use std::collections::{BTreeMap, BTreeSet};

use gpuhealth_api::contract::{GpuEntry, XidEvent};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};

use super::parse::{KernelEvent, PciAddress, parse_line};
use crate::judgement;

/// How many Xids per GPU the report carries (newest kept).
pub const XIDS_PER_GPU: usize = 16;

/// How many GPUs the kernel log may describe: a GPU report carries at
/// most 64, and a log that names more (corrupt, or hostile) must not grow
/// the agent without bound. Lines about further PCI addresses are ignored.
pub const GPUS_TRACKED: usize = 64;

/// The same Xid on the same GPU within this many seconds is one event seen
/// twice (in the kernel log and through NVML).
const DUPLICATE_WINDOW_SECS: i64 = 2;

/// What the kernel log has said about each GPU so far.
#[derive(Debug, Default)]
pub struct KernelLog {
    uuids: BTreeMap<PciAddress, String>,
    xids: BTreeMap<PciAddress, Vec<XidEvent>>,
    /// The newest recovery action an Xid 154 announced, per GPU.
    recovery: BTreeMap<PciAddress, u32>,
}

impl KernelLog {
    /// Takes in one line, stamped `at` (when it was logged, if known), and
    /// returns its Xid code if it is an Xid line.
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
                self.add_xid(x.pci, x.code, at, &x.text).then_some(x.code)
            }
            Some(_) | None => None,
        }
    }

    /// Records an Xid, unless the same one was just recorded (the kernel
    /// log and NVML's events both report each): false then.
    pub fn add_xid(&mut self, pci: PciAddress, code: u32, at: Timestamp, text: &str) -> bool {
        if !self.tracks(&pci) {
            return false;
        }
        let list = self.xids.entry(pci).or_default();
        let repeat = list.iter().rev().take(4).any(|x| {
            x.code == code && (x.at.0.as_second() - at.as_second()).abs() <= DUPLICATE_WINDOW_SECS
        });
        if repeat {
            return false;
        }
        list.push(XidEvent {
            code,
            at: Time(at),
            text: text.chars().take(256).collect(),
        });
        let over = list.len().saturating_sub(XIDS_PER_GPU);
        list.drain(..over);
        true
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

    /// The Xids logged for the GPU at `pci`, oldest first.
    pub fn xids(&self, pci: &PciAddress) -> &[XidEvent] {
        self.xids.get(pci).map_or(&[], Vec::as_slice)
    }

    /// The GPUs as the log alone describes them: for a node where NVML
    /// cannot be loaded. A GPU whose UUID the driver never logged cannot be
    /// named, and is left out.
    pub fn entries(&self) -> Vec<GpuEntry> {
        // In PCI order (the map's), which is how the driver numbers them.
        self.uuids
            .iter()
            .enumerate()
            .map(|(index, (pci, uuid))| {
                let xids = self.xids(pci).to_vec();
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
        let gpus = log.entries();
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
        assert_eq!(log.entries().len(), GPUS_TRACKED);
        assert_eq!(log.gpus_known(), GPUS_TRACKED);
        // The GPUs it knows still take new lines.
        let first = log.entries()[0].clone();
        assert_eq!(
            log.xids(&PciAddress::parse("0000:00:00").expect("pci"))
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
            let _ = log.entries();
        }
    }
}
