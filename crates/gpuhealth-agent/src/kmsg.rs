//! The kernel log: `NVRM: Xid` lines and the driver's PCI → UUID lines, from
//! `/dev/kmsg` records, `dmesg -T` output or the journal alike. It catches
//! what happened before NVML events were registered.
//!
//! The parser takes any text, never panics, and skips what it cannot read.

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader},
    path::PathBuf,
};

use gpuhealth_api::contract::{GpuEntry, XidEvent};
use gpuhealth_engine::xid::recovery_action_in_text;
use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::{SignedDuration, Timestamp},
};
use prometheus_client::metrics::{counter::Counter, family::Family};

use crate::{judgement, metrics::CodeLabels};

/// What one kernel log line says about a GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelEvent {
    Xid(XidLine),
    /// `NVRM: GPU at PCI:0000:e1:00: GPU-…`: names the GPU at a PCI address.
    GpuAt {
        pci: PciAddress,
        uuid: String,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct XidLine {
    pub pci: PciAddress,
    pub code: u32,
    /// The process the driver blamed, when it named one.
    pub pid: Option<u32>,
    pub process: Option<String>,
    /// MIG GPU instance and compute instance, when the line names them.
    pub gpu_instance: Option<u32>,
    pub compute_instance: Option<u32>,
    pub text: String,
    /// For Xid 154: the new recovery action (decided on the hex value).
    pub recovery_action: Option<u32>,
    /// Microseconds since boot, from a `/dev/kmsg` record's header.
    pub since_boot_us: Option<u64>,
}

/// A PCI address as domain, bus and device: the kernel log writes
/// `0000:e1:00`, NVML and nvidia-smi `00000000:E1:00.0`; both name the same GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciAddress {
    pub domain: u32,
    pub bus: u8,
    pub device: u8,
}

impl PciAddress {
    /// Reads `DDDD:BB:DD`, `DDDDDDDD:BB:DD.F` and the like, in any case,
    /// with or without a `PCI:` prefix.
    pub fn parse(s: &str) -> Option<PciAddress> {
        let s = s.trim();
        let s = s
            .strip_prefix("PCI:")
            .or_else(|| s.strip_prefix("pci:"))
            .unwrap_or(s);
        let mut parts = s.split(':');
        let (domain, bus, device) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() {
            return None;
        }
        let device = device.split_once('.').map_or(device, |(d, _function)| d);
        let hex = |p: &str, max: usize| {
            (!p.is_empty() && p.len() <= max && p.chars().all(|c| c.is_ascii_hexdigit()))
                .then(|| u32::from_str_radix(p, 16).ok())
                .flatten()
        };
        Some(PciAddress {
            domain: hex(domain, 8)?,
            bus: u8::try_from(hex(bus, 2)?).ok()?,
            device: u8::try_from(hex(device, 2)?).ok()?,
        })
    }
}

impl std::fmt::Display for PciAddress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}",
            self.domain, self.bus, self.device
        )
    }
}

/// Parses one line; `None` for anything that is not a GPU line we know.
pub fn parse_line(line: &str) -> Option<KernelEvent> {
    let since_boot_us = kmsg_timestamp(line);
    let (_, message) = line.split_once("NVRM: ")?;
    if let Some(rest) = message.strip_prefix("Xid (") {
        return parse_xid(rest, since_boot_us).map(KernelEvent::Xid);
    }
    let rest = message.strip_prefix("GPU at ")?;
    let (pci, uuid) = rest.split_once(": ")?;
    let uuid = uuid.trim();
    // The same shape the report contract accepts: GPU- and 8 to 64 of hex and dashes.
    let valid = uuid.strip_prefix("GPU-").is_some_and(|body| {
        (8..=64).contains(&body.len())
            && body.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
            && body.chars().any(|c| c.is_ascii_hexdigit())
    });
    if !valid {
        return None;
    }
    Some(KernelEvent::GpuAt {
        pci: PciAddress::parse(pci)?,
        uuid: uuid.to_owned(),
    })
}

/// `/dev/kmsg` records start `PRIORITY,SEQ,MICROSECONDS,FLAGS;`.
fn kmsg_timestamp(line: &str) -> Option<u64> {
    let (header, _) = line.split_once(';')?;
    let mut fields = header.split(',');
    let (_priority, _seq, micros) = (fields.next()?, fields.next()?, fields.next()?);
    micros.parse().ok()
}

fn parse_xid(rest: &str, since_boot_us: Option<u64>) -> Option<XidLine> {
    let (inside, after) = rest.split_once("):")?;
    let mut pci = None;
    let mut gpu_instance = None;
    let mut compute_instance = None;
    for token in inside.split_whitespace() {
        if let Some(v) = token.strip_prefix("GPU-I:") {
            gpu_instance = v.parse().ok();
        } else if let Some(v) = token.strip_prefix("GPU-CI:") {
            compute_instance = v.parse().ok();
        } else if pci.is_none() {
            pci = PciAddress::parse(token);
        }
    }
    let after = after.trim_start();
    let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
    let code: u32 = digits.parse().ok()?;
    let mut text = after[digits.len()..].trim_start_matches(',').trim_start();
    let mut pid = None;
    let mut process = None;
    if let Some(v) = text.strip_prefix("pid=") {
        let (value, more) = v.split_once(", ").unwrap_or((v, ""));
        pid = value.trim_matches('\'').parse().ok();
        text = more;
    }
    if let Some(v) = text.strip_prefix("name=") {
        let (value, more) = v.split_once(", ").unwrap_or((v, ""));
        process = (value != "<unknown>").then(|| value.to_owned());
        text = more;
    }
    let text = text.trim().to_owned();
    Some(XidLine {
        pci: pci?,
        code,
        pid,
        process,
        gpu_instance,
        compute_instance,
        recovery_action: (code == 154)
            .then(|| recovery_action_in_text(&text))
            .flatten(),
        text,
        since_boot_us,
    })
}

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
        let mut all: std::collections::BTreeSet<&PciAddress> = self.uuids.keys().collect();
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
                }
            })
            .collect()
    }
}

/// The longest line taken in: a kernel log record is at most about 1 KiB;
/// a plain file may hold anything.
pub const MAX_LINE: usize = 4096;

/// Lines read but not yet handled, at most.
const LINES_QUEUED: usize = 4096;

/// Reads one line into `line`, keeping at most [`MAX_LINE`] bytes of it and
/// skipping the rest; the bytes consumed (0 at the end of the file).
fn read_bounded_line(reader: &mut impl BufRead, line: &mut String) -> std::io::Result<usize> {
    let mut bytes = Vec::new();
    let mut consumed = 0;
    loop {
        let (done, used) = {
            let available = match reader.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            if available.is_empty() {
                (true, 0)
            } else {
                let end = available.iter().position(|&b| b == b'\n');
                let used = end.map_or(available.len(), |i| i + 1);
                let room = MAX_LINE.saturating_sub(bytes.len());
                bytes.extend_from_slice(&available[..used.min(room)]);
                (end.is_some(), used)
            }
        };
        reader.consume(used);
        consumed += used;
        if done {
            break;
        }
    }
    line.push_str(&String::from_utf8_lossy(&bytes));
    Ok(consumed)
}

/// Follows a kernel log: `/dev/kmsg` (which replays the ring buffer first, so
/// what happened before the agent started is seen too) or a plain file,
/// read to its end and then polled for more. Each line goes to `lines`,
/// with when it was logged where the record says so; a full channel holds
/// the reading back (a flood is read as fast as it is handled, never
/// queued without bound). Lines are cut at [`MAX_LINE`] bytes.
pub fn follow(
    path: PathBuf,
    lines: std::sync::mpsc::SyncSender<(String, Timestamp)>,
) -> std::io::Result<()> {
    let file = std::fs::File::open(&path)?;
    let boot = boot_time();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(file);
        let mut line = String::new();
        loop {
            line.clear();
            match read_bounded_line(&mut reader, &mut line) {
                // End of a plain file: wait for more to be written.
                Ok(0) => std::thread::sleep(std::time::Duration::from_millis(200)),
                Ok(_) => {
                    let at = match (boot, kmsg_timestamp(&line)) {
                        (Some(boot), Some(us)) => boot
                            .checked_add(SignedDuration::from_micros(us as i64))
                            .unwrap_or_else(|_| Timestamp::now()),
                        _ => Timestamp::now(),
                    };
                    if lines.send((line.trim_end().to_owned(), at)).is_err() {
                        return;
                    }
                }
                // /dev/kmsg says EPIPE when records were overwritten before
                // we read them: carry on from the oldest still there.
                Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
                Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {}
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "reading the kernel log stopped");
                    return;
                }
            }
        }
    });
    Ok(())
}

/// Where in the ring buffer [`follow_syslog`] has read to: the last
/// timestamp taken, and how many lines with it.
#[derive(Debug, Default)]
struct Cursor {
    last: Option<u64>,
    at_last: usize,
}

/// One `syslog(2)` line, `<PRIORITY>[SECONDS.MICROS] MESSAGE`, as the
/// `/dev/kmsg` record the rest of this module reads; `None` without a
/// timestamp (`printk.time=0`), which could not be told from a repeat.
fn syslog_record(line: &str) -> Option<(u64, String)> {
    let (priority, rest) = line.strip_prefix('<')?.split_once('>')?;
    let (stamp, message) = rest.strip_prefix('[')?.split_once(']')?;
    let (secs, micros) = stamp.trim().split_once('.')?;
    let us = secs.parse::<u64>().ok()?.checked_mul(1_000_000)? + micros.parse::<u64>().ok()?;
    let priority: u32 = priority.parse().ok()?;
    let message = message.strip_prefix(' ').unwrap_or(message);
    Some((us, format!("{priority},0,{us},-;{message}")))
}

/// The records in a read of the whole buffer that `cursor` has not taken
/// yet, oldest first; moves the cursor past them.
fn unread(buffer: &str, cursor: &mut Cursor) -> Vec<(u64, String)> {
    let mut out = Vec::new();
    let mut same = 0;
    let mut last = cursor.last;
    for (us, record) in buffer.lines().filter_map(syslog_record) {
        same = if Some(us) == last { same + 1 } else { 1 };
        last = Some(us);
        let new = match cursor.last {
            None => true,
            Some(seen) => us > seen || (us == seen && same > cursor.at_last),
        };
        if new {
            out.push((us, record));
        }
    }
    if let Some((us, _)) = out.last() {
        let taken_at_last = out.iter().filter(|(u, _)| u == us).count();
        cursor.at_last = if cursor.last == Some(*us) {
            cursor.at_last + taken_at_last
        } else {
            taken_at_last
        };
        cursor.last = Some(*us);
    }
    out
}

/// Follows the kernel log through `syslog(2)`, for where `/dev/kmsg` cannot
/// be opened: a container that is not privileged may not open the device
/// (its device cgroup says no), but with CAP_SYSLOG it may read the ring
/// buffer. Read whole each second; each line goes to `lines` once, the
/// buffer's earlier lines first, as `/dev/kmsg` replays them.
pub fn follow_syslog(
    lines: std::sync::mpsc::SyncSender<(String, Timestamp)>,
) -> std::io::Result<()> {
    let mut buffer = Vec::new();
    // Fails here, not in the thread, without CAP_SYSLOG.
    let first = gpuhealth_klog::read_all(&mut buffer)?;
    let boot = boot_time();
    std::thread::spawn(move || {
        let mut cursor = Cursor::default();
        let mut text = first;
        loop {
            for (us, record) in unread(&text, &mut cursor) {
                let at = boot
                    .and_then(|b| b.checked_add(SignedDuration::from_micros(us as i64)).ok())
                    .unwrap_or_else(Timestamp::now);
                let mut record = record;
                record.truncate(MAX_LINE);
                if lines.send((record, at)).is_err() {
                    return;
                }
            }
            std::thread::sleep(std::time::Duration::from_secs(1));
            text = match gpuhealth_klog::read_all(&mut buffer) {
                Ok(t) => t,
                Err(e) => {
                    tracing::warn!(error = %e, "reading the kernel log through syslog(2) stopped");
                    return;
                }
            };
        }
    });
    Ok(())
}

/// The Xids as they arrive, from the kernel log and NVML's events, and a
/// signal each time one does, so the agent publishes at once rather than at
/// its next poll.
#[derive(Clone)]
pub struct Feed {
    pub log: std::sync::Arc<std::sync::Mutex<KernelLog>>,
    pub wake: std::sync::Arc<tokio::sync::Notify>,
    xids: Family<CodeLabels, Counter>,
}

impl Feed {
    /// Counts each Xid in `xids` by code.
    pub fn new(xids: Family<CodeLabels, Counter>) -> Feed {
        Feed {
            log: Default::default(),
            wake: Default::default(),
            xids,
        }
    }

    /// Follows the kernel log at `path`, or, where that may not be opened
    /// (`/dev/kmsg` in a container that is not privileged), through
    /// `syslog(2)`; says which.
    pub fn follow(&self, path: PathBuf) -> std::io::Result<&'static str> {
        let (tx, rx) = std::sync::mpsc::sync_channel::<(String, Timestamp)>(LINES_QUEUED);
        let how = match follow(path.clone(), tx.clone()) {
            Ok(()) => "the file",
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
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
                if line.contains("NVRM: ") {
                    let code = feed.with(|l| l.take(&line, at));
                    feed.arrived(code);
                }
            }
        });
        Ok(how)
    }

    /// An Xid from NVML's event set, for the GPU at `pci_bus_id`.
    pub fn nvml_xid(&self, pci_bus_id: &str, code: u32) {
        let Some(pci) = PciAddress::parse(pci_bus_id) else {
            return;
        };
        let new = self.with(|l| l.add_xid(pci, code, Timestamp::now(), "reported by NVML"));
        self.arrived(new.then_some(code));
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
        let mut guard = self.log.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut guard)
    }
}

/// When this machine booted: `/dev/kmsg` stamps records in microseconds since.
fn boot_time() -> Option<Timestamp> {
    let uptime = std::fs::read_to_string("/proc/uptime").ok()?;
    let secs: f64 = uptime.split_whitespace().next()?.parse().ok()?;
    Timestamp::now()
        .checked_sub(SignedDuration::from_secs_f64(secs))
        .ok()
}

#[cfg(test)]
mod tests {
    use gpuhealth_api::GpuHealth;

    use super::*;

    fn xid(line: &str) -> XidLine {
        match parse_line(line) {
            Some(KernelEvent::Xid(x)) => x,
            other => panic!("not an Xid line: {line:?} gave {other:?}"),
        }
    }

    const E1: PciAddress = PciAddress {
        domain: 0,
        bus: 0xe1,
        device: 0,
    };

    #[test]
    fn syslog_lines_are_read_as_kmsg_records_each_once() {
        let first = "<6>[    5.000001] boot\n<4>[  100.250000] NVRM: Xid (PCI:0000:e1:00): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)\n<6>[  100.250000] twin\n";
        let mut cursor = Cursor::default();
        let read = unread(first, &mut cursor);
        assert_eq!(read.len(), 3);
        assert_eq!(read[1].0, 100_250_000);
        assert!(
            read[1]
                .1
                .starts_with("4,0,100250000,-;NVRM: Xid (PCI:0000:e1:00): 154")
        );
        assert!(matches!(parse_line(&read[1].1), Some(KernelEvent::Xid(x)) if x.code == 154));
        // Read again with one more line: only that one, though it shares
        // the last one's time.
        let second = format!(
            "{first}<6>[  100.250000] third at that time\n<6>[  101.000000] later\nno time\n"
        );
        let read = unread(&second, &mut cursor);
        let said: Vec<&str> = read
            .iter()
            .map(|(_, r)| r.split_once(';').map_or("", |(_, m)| m))
            .collect();
        assert_eq!(said, ["third at that time", "later"]);
        assert!(unread(&second, &mut cursor).is_empty(), "nothing twice");
        // The buffer wrapped: its oldest lines are gone, the rest are known.
        let wrapped = "<6>[  101.000000] later\n<6>[  102.000000] newest\n";
        let read = unread(wrapped, &mut cursor);
        assert_eq!(read.len(), 1);
        assert!(read[0].1.ends_with(";newest"));
    }

    #[test]
    fn the_incident_lines_from_dmesg() {
        let x = xid(
            "[Fri May 29 08:24:51 2026] NVRM: Xid (PCI:0000:e1:00): 119, Timeout after 45s of waiting for RPC response from GPU GSP",
        );
        assert_eq!((x.pci, x.code, x.pid), (E1, 119, None));
        assert!(x.text.starts_with("Timeout after 45s"), "{}", x.text);
        // The seed's driver wrote words, not hex.
        let x = xid(
            "NVRM: Xid (PCI:0000:e1:00): 154, GPU recovery action changed from None to GPU Reset Required",
        );
        assert_eq!((x.code, x.recovery_action), (154, Some(1)));
    }

    #[test]
    fn xid_154_is_decided_by_its_hex_value() {
        for (text, action) in [
            (
                "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
                1,
            ),
            (
                "GPU recovery action changed from 0x0 (None) to 0x2 (OS Reboot)",
                2,
            ),
            (
                "GPU recovery action changed from 0x0 (None) to 0x1 (PF FLR)",
                1,
            ),
            (
                "GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)",
                0,
            ),
        ] {
            let x = xid(&format!("NVRM: Xid (PCI:0000:e1:00): 154, {text}"));
            assert_eq!(x.recovery_action, Some(action), "{text}");
        }
    }

    #[test]
    fn kmsg_records_pids_names_and_mig() {
        let x = xid(
            "4,1523,98765432,-;NVRM: Xid (PCI:0000:3b:00 GPU-I:05 GPU-CI:01): 13, pid=4242, name=python3, Graphics Exception",
        );
        assert_eq!(x.since_boot_us, Some(98_765_432));
        assert_eq!(x.pci.bus, 0x3b);
        assert_eq!((x.gpu_instance, x.compute_instance), (Some(5), Some(1)));
        assert_eq!((x.pid, x.process.as_deref()), (Some(4242), Some("python3")));
        assert_eq!(x.text, "Graphics Exception");

        let x = xid(
            "NVRM: Xid (PCI:0000:01:00): 31, pid='<unknown>', name=<unknown>, Ch 00000010, intr 10000000. MMU Fault",
        );
        assert_eq!((x.pid, x.process), (None, None));
        assert!(x.text.starts_with("Ch 00000010"), "{}", x.text);

        let x = xid("kernel: NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.");
        assert_eq!(
            (x.code, x.text.as_str()),
            (79, "GPU has fallen off the bus.")
        );
    }

    #[test]
    fn unknown_codes_and_truncated_lines() {
        // A code the catalogue does not know is still reported.
        let x = xid("NVRM: Xid (PCI:0000:e1:00): 4242, pid=1, name=x, Something new");
        assert_eq!((x.code, x.text.as_str()), (4242, "Something new"));
        // Cut short by the ring buffer or a reader: what is there is kept.
        let x = xid("NVRM: Xid (PCI:0000:e1:00): 119, Timeout after 4");
        assert_eq!(x.text, "Timeout after 4");
        let x = xid(
            "NVRM: Xid (PCI:0000:e1:00): 154, GPU recovery action changed from 0x0 (None) to 0x",
        );
        assert_eq!(x.recovery_action, None, "no value to act on");
        for cut in [
            "NVRM: Xid (PCI:0000:e1:00",
            "NVRM: Xid (PCI:0000:e1:00):",
            "NVRM: Xid (PCI:0000:e1:00): ",
            "NVRM: GPU at PCI:0000:e1:00: GPU-",
            "NVRM: GPU at PCI:0000:e1",
        ] {
            assert_eq!(parse_line(cut), None, "{cut:?}");
        }
        // Binary garbage around a good record.
        let x = xid(
            "\u{0}\u{7f}\u{fffd}4,9,9,-;NVRM: Xid (PCI:0000:e1:00): 79, GPU has fallen off the bus.",
        );
        assert_eq!(x.code, 79);
    }

    #[test]
    fn the_driver_names_each_gpu_by_pci_address() {
        assert_eq!(
            parse_line("NVRM: GPU at PCI:0000:e1:00: GPU-0a1b2c3d-0000-4000-8000-000000000007"),
            Some(KernelEvent::GpuAt {
                pci: E1,
                uuid: "GPU-0a1b2c3d-0000-4000-8000-000000000007".into()
            })
        );
    }

    #[test]
    fn kernel_and_nvml_addresses_are_the_same_gpu() {
        assert_eq!(PciAddress::parse("00000000:E1:00.0"), Some(E1));
        assert_eq!(PciAddress::parse("PCI:0000:e1:00"), Some(E1));
        assert_eq!(E1.to_string(), "0000:e1:00");
        for bad in ["", "e1:00", "0000:e1:00:00", "0000:zz:00", "0000:100:00"] {
            assert_eq!(PciAddress::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_real_drivers_other_lines_are_skipped() {
        // /dev/kmsg of an H200 VM (docs/device/h200-nvml/): NVRM lines, no Xid.
        let real = include_str!("../../../docs/device/h200-nvml/kmsg-nvrm.txt");
        assert_eq!(real.lines().count(), 3);
        for line in real.lines() {
            assert_eq!(parse_line(line), None, "{line:?}");
        }
    }

    #[test]
    fn other_lines_and_garbage_are_skipped() {
        for line in [
            "",
            "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  570.133.20",
            "NVRM: Xid (",
            "NVRM: Xid (PCI:0000:e1:00): , no code",
            "NVRM: Xid (garbage): 119, x",
            "NVRM: GPU at PCI:0000:e1:00: not-a-uuid",
            "6,1,2,-;usb 1-1: new high-speed USB device",
        ] {
            assert_eq!(parse_line(line), None, "{line:?}");
        }
    }

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

    #[test]
    fn an_xid_seen_in_the_log_and_through_nvml_counts_once() {
        let xids: Family<CodeLabels, Counter> = Family::default();
        let feed = Feed::new(xids.clone());
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
        let codes: Vec<u32> = feed.with(|l| l.xids(&E1).iter().map(|x| x.code).collect());
        assert_eq!(codes, [119, 48]);
        let count = |c: &str| xids.get_or_create(&CodeLabels { code: c.into() }).get();
        assert_eq!((count("119"), count("48")), (1, 1));
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

    /// Found for issue 9: a kernel log line was read whole, however long; a
    /// file with no newline in it grew the agent without bound.
    #[test]
    fn an_endless_line_is_cut_and_the_next_one_read_whole() {
        let text = format!(
            "{}\nNVRM: Xid (PCI:0000:e1:00): 48, DBE\n",
            "x".repeat(1 << 20)
        );
        let mut reader = std::io::BufReader::new(text.as_bytes());
        let mut line = String::new();
        assert_eq!(
            read_bounded_line(&mut reader, &mut line).expect("read"),
            (1 << 20) + 1
        );
        assert_eq!(line.len(), MAX_LINE);
        line.clear();
        read_bounded_line(&mut reader, &mut line).expect("read");
        assert_eq!(line, "NVRM: Xid (PCI:0000:e1:00): 48, DBE\n");
        line.clear();
        assert_eq!(read_bounded_line(&mut reader, &mut line).expect("read"), 0);
    }

    #[test]
    fn a_followed_file_delivers_what_is_appended() {
        use std::io::Write;
        let path = std::env::temp_dir().join(format!("gpuhealth-kmsg-{}", std::process::id()));
        let mut file = std::fs::File::create(&path).expect("file");
        writeln!(
            file,
            "6,1,100,-;NVRM: GPU at PCI:0000:e1:00: GPU-0a1b2c3d-0000-4000-8000-000000000007"
        )
        .expect("write");
        let (tx, rx) = std::sync::mpsc::sync_channel(16);
        follow(path.clone(), tx).expect("follow");
        let (first, _) = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the first line");
        assert!(first.contains("GPU at"), "{first}");
        writeln!(file, "4,2,200,-;NVRM: Xid (PCI:0000:e1:00): 119, Timeout").expect("append");
        let (second, _) = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the appended line");
        assert!(second.contains("Xid"), "{second}");
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

        #[test]
        fn never_panics(line in ".{0,200}") {
            let _ = parse_line(&line);
        }

        #[test]
        fn never_panics_near_the_format(
            inside in "[ -~]{0,30}",
            code in "[0-9a-z,']{0,12}",
            rest in "[ -~]{0,60}",
        ) {
            let _ = parse_line(&format!("NVRM: Xid ({inside}): {code}, {rest}"));
            let _ = parse_line(&format!("NVRM: GPU at {inside}: {rest}"));
        }
    }
}
