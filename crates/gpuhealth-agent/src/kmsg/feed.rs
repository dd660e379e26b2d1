//! The feed: each line the followers read goes into the one [`KernelLog`],
//! NVML's Xid events go in beside them, and each new Xid is counted and
//! wakes the agent, so it publishes at once rather than at its next poll.

use std::{path::PathBuf, sync::Arc};

use k8s_openapi::jiff::Timestamp;
use parking_lot::Mutex;
use prometheus_client::metrics::{counter::Counter, family::Family};

use super::{
    follow::{follow, follow_syslog},
    parse::{PciAddress, parse_line},
    store::KernelLog,
};
use crate::metrics::CodeLabels;

/// Lines read but not yet handled, at most.
const LINES_QUEUED: usize = 4096;

/// The Xids as they arrive, from the kernel log and NVML's events, and a
/// signal each time one does, so the agent publishes at once rather than at
/// its next poll.
#[derive(Clone)]
pub struct Feed {
    pub log: Arc<Mutex<KernelLog>>,
    pub wake: Arc<tokio::sync::Notify>,
    xids: Family<CodeLabels, Counter>,
    not_the_drivers: Counter,
}

/// Where a line names a GPU as the driver's own lines do.
const DRIVER_WORDS: [&str; 2] = ["NVRM: Xid (", "NVRM: GPU at "];

impl Feed {
    /// Counts each Xid in `xids` by code, and in `not_the_drivers` each
    /// line that reads like one of the driver's but is not.
    pub fn new(xids: Family<CodeLabels, Counter>, not_the_drivers: Counter) -> Feed {
        Feed {
            log: Default::default(),
            wake: Default::default(),
            xids,
            not_the_drivers,
        }
    }

    /// Follows the kernel log at `path`, or, where that is not there or may
    /// not be opened (`/dev/kmsg` in a container that is not privileged:
    /// the runtime makes no such device, and its device cgroup refuses a
    /// mounted one), through `syslog(2)`; says which.
    pub fn follow(&self, path: PathBuf) -> std::io::Result<&'static str> {
        let (tx, rx) = std::sync::mpsc::sync_channel::<(String, Timestamp)>(LINES_QUEUED);
        let how = match follow(path.clone(), tx.clone()) {
            Ok(()) => "the file",
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::NotFound
                ) =>
            {
                follow_syslog(tx).map_err(|s| {
                    std::io::Error::other(format!("{}: {e}; syslog(2): {s}", path.display()))
                })?;
                "syslog(2)"
            }
            Err(e) => return Err(e),
        };
        let feed = self.clone();
        std::thread::spawn(move || {
            for (line, at) in rx {
                if !line.contains("NVRM: ") {
                    continue;
                }
                if DRIVER_WORDS.iter().any(|w| line.contains(w)) && parse_line(&line).is_none() {
                    feed.not_the_drivers.inc();
                    tracing::warn!(line = %line, "a kernel log line that reads like the driver's but is not its own: not read");
                    continue;
                }
                let code = feed.with(|l| l.take(&line, at));
                feed.arrived(code);
            }
        });
        Ok(how)
    }

    /// An Xid from NVML's event set, for the GPU at `pci_bus_id`.
    pub fn nvml_xid(&self, pci_bus_id: &str, code: u32) {
        let Some(pci) = PciAddress::parse(pci_bus_id) else {
            return;
        };
        let new = self.with(|l| l.nvml_xid(pci, code, Timestamp::now()));
        self.arrived(new.then_some(code));
    }

    /// NVML's Xid events are up (`true`) or no longer: while they are, an
    /// Xid the kernel log alone tells is not believed without them.
    pub fn nvml_listening(&self, up: bool) {
        self.with(|l| l.nvml_listening(up.then(Timestamp::now)));
    }

    fn arrived(&self, code: Option<u32>) {
        if let Some(code) = code {
            self.xids
                .get_or_create(&CodeLabels {
                    code: code.to_string(),
                })
                .inc();
        }
        self.wake.notify_one();
    }

    pub fn with<T>(&self, f: impl FnOnce(&mut KernelLog) -> T) -> T {
        f(&mut self.log.lock())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_xid_seen_in_the_log_and_through_nvml_counts_once() {
        let xids: Family<CodeLabels, Counter> = Family::default();
        let feed = Feed::new(xids.clone(), Counter::default());
        let now = Timestamp::now();
        let code = feed.with(|l| {
            l.take(
                "NVRM: GPU at PCI:0000:e1:00: GPU-0a1b2c3d-0000-4000-8000-000000000007",
                now,
            );
            l.take("NVRM: Xid (PCI:0000:e1:00): 119, Timeout after 45s", now)
        });
        feed.arrived(code);
        feed.nvml_xid("00000000:E1:00.0", 119);
        feed.nvml_xid("00000000:E1:00.0", 48);
        let e1 = PciAddress::parse("0000:e1:00").expect("pci");
        let codes: Vec<u32> = feed.with(|l| {
            l.xids(&e1, Timestamp::now(), false)
                .iter()
                .map(|x| x.code)
                .collect()
        });
        assert_eq!(codes, [119, 48]);
        let count = |c: &str| xids.get_or_create(&CodeLabels { code: c.into() }).get();
        assert_eq!((count("119"), count("48")), (1, 1));
    }
}
