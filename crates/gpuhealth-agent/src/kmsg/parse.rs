//! Reading kernel log lines: `NVRM: Xid` lines and the driver's PCI → UUID
//! lines, from `/dev/kmsg` records, `dmesg -T` output or the journal alike.
//!
//! The parser takes any text, never panics, and skips what it cannot read.

use gpuhealth_engine::xid::recovery_action_in_text;

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

/// Parses one line; `None` for anything that is not one of the driver's own
/// GPU lines. The driver's grammar is anchored at the start of the message:
/// a tenant's process chooses its own name and the names of its files, and
/// the kernel prints both at the start and in the middle of its crash
/// messages (`NAME[PID]: segfault at ... in FILE[...]`), so a line that
/// merely contains `NVRM: Xid (` says nothing about a GPU.
pub fn parse_line(line: &str) -> Option<KernelEvent> {
    let record = Record::read(line)?;
    if let Some(rest) = record.message.strip_prefix("NVRM: Xid (PCI:") {
        return parse_xid(rest, record.since_boot_us).map(KernelEvent::Xid);
    }
    let rest = record.message.strip_prefix("NVRM: GPU at PCI:")?;
    let (pci, uuid) = kernel_pci(rest)?;
    let uuid = uuid.strip_prefix(": ")?.trim_end();
    // The same shape the report contract accepts: GPU- and 8 to 64 of hex and dashes.
    let valid = uuid.strip_prefix("GPU-").is_some_and(|body| {
        (8..=64).contains(&body.len())
            && body.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
            && body.chars().any(|c| c.is_ascii_hexdigit())
    });
    valid.then(|| KernelEvent::GpuAt {
        pci,
        uuid: uuid.to_owned(),
    })
}

/// Where a line's message starts, and what its header says.
struct Record<'a> {
    message: &'a str,
    since_boot_us: Option<u64>,
}

/// The kernel's own facility (`LOG_KERN`): a `/dev/kmsg` record's priority
/// is `facility << 3 | level`. Whatever a process writes into `/dev/kmsg`
/// gets another facility (`LOG_USER` unless it says otherwise, and never
/// the kernel's).
const KERNEL_FACILITY: u32 = 0;

impl<'a> Record<'a> {
    /// A `/dev/kmsg` record (`PRIORITY,SEQ,MICROSECONDS,FLAGS;MESSAGE`,
    /// which the `syslog(2)` reader writes too), a `dmesg` line
    /// (`[STAMP] MESSAGE`) or a bare message; `None` for a record a process
    /// wrote rather than the kernel.
    fn read(line: &'a str) -> Option<Record<'a>> {
        if let Some((header, message)) = kmsg_header(line) {
            return (header.priority >> 3 == KERNEL_FACILITY).then_some(Record {
                message,
                since_boot_us: Some(header.since_boot_us),
            });
        }
        let message = match line.strip_prefix('[') {
            Some(stamped) => stamped.split_once("] ")?.1,
            None => line,
        };
        Some(Record {
            message,
            since_boot_us: None,
        })
    }
}

/// What a `/dev/kmsg` record's header says.
struct KmsgHeader {
    priority: u32,
    since_boot_us: u64,
}

/// `/dev/kmsg` records start `PRIORITY,SEQ,MICROSECONDS,FLAGS[,...];`:
/// the header and the message after it.
fn kmsg_header(line: &str) -> Option<(KmsgHeader, &str)> {
    let (header, message) = line.split_once(';')?;
    let mut fields = header.split(',');
    let (priority, seq, micros, _flags) = (
        fields.next()?,
        fields.next()?,
        fields.next()?,
        fields.next()?,
    );
    seq.parse::<u64>().ok()?;
    Some((
        KmsgHeader {
            priority: priority.parse().ok()?,
            since_boot_us: micros.parse().ok()?,
        },
        message,
    ))
}

/// When a `/dev/kmsg` record was logged, in microseconds since boot.
pub(super) fn kmsg_timestamp(line: &str) -> Option<u64> {
    kmsg_header(line).map(|(h, _)| h.since_boot_us)
}

/// The address as the driver prints it after `PCI:`, `%04x:%02x:%02x`
/// (a domain past 0xffff takes more digits), and what follows it.
fn kernel_pci(s: &str) -> Option<(PciAddress, &str)> {
    let hex_run = |s: &str| s.find(|c: char| !c.is_ascii_hexdigit()).unwrap_or(s.len());
    let domain_len = hex_run(s);
    if !(4..=8).contains(&domain_len) {
        return None;
    }
    let (domain, rest) = s.split_at(domain_len);
    let rest = rest.strip_prefix(':')?;
    let (bus, rest) = (rest.get(..2)?, rest.get(2..)?);
    let rest = rest.strip_prefix(':')?;
    let (device, rest) = (rest.get(..2)?, rest.get(2..)?);
    if hex_run(bus) != 2
        || hex_run(device) != 2
        || rest.starts_with(|c: char| c.is_ascii_hexdigit())
    {
        return None;
    }
    Some((
        PciAddress {
            domain: u32::from_str_radix(domain, 16).ok()?,
            bus: u8::from_str_radix(bus, 16).ok()?,
            device: u8::from_str_radix(device, 16).ok()?,
        },
        rest,
    ))
}

/// The decimal number `s` starts with, and what follows it.
fn leading_number(s: &str) -> Option<(u32, &str)> {
    let end = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, rest) = s.split_at(end);
    Some((digits.parse().ok()?, rest))
}

/// The rest of `NVRM: Xid (PCI:DDDD:BB:DD[ GPU-I:NN][ GPU-CI:NN]): CODE, TEXT`.
fn parse_xid(rest: &str, since_boot_us: Option<u64>) -> Option<XidLine> {
    let (pci, mut rest) = kernel_pci(rest)?;
    let mut gpu_instance = None;
    let mut compute_instance = None;
    if let Some(after) = rest.strip_prefix(" GPU-I:") {
        let (n, after) = leading_number(after)?;
        (gpu_instance, rest) = (Some(n), after);
    }
    if let Some(after) = rest.strip_prefix(" GPU-CI:") {
        let (n, after) = leading_number(after)?;
        (compute_instance, rest) = (Some(n), after);
    }
    let (code, after) = leading_number(rest.strip_prefix("): ")?)?;
    let mut text = after.strip_prefix(',')?.trim_start();
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
        pci,
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

#[cfg(test)]
mod tests {
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

        let x = xid("[  457.337975] NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.");
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
        // Garbage before a record's header: where its message starts cannot
        // be known, so nothing in it is read.
        assert_eq!(
            parse_line(
                "\u{0}\u{7f}\u{fffd}4,9,9,-;NVRM: Xid (PCI:0000:e1:00): 79, GPU has fallen off the bus."
            ),
            None
        );
        // Garbage after a good record is its text.
        let x = xid("4,9,9,-;NVRM: Xid (PCI:0000:e1:00): 79, \u{0}\u{7f}\u{fffd}");
        assert_eq!(x.code, 79);
    }

    /// A process may write into `/dev/kmsg` (a privileged container, a
    /// root one with the device), but never with the kernel's facility.
    #[test]
    fn a_record_a_process_wrote_into_kmsg_is_not_read() {
        let driver =
            "4,1523,98765432,-;NVRM: Xid (PCI:0000:e1:00): 79, GPU has fallen off the bus.";
        assert_eq!(xid(driver).code, 79);
        // LOG_USER (1 << 3 | 4), and any other facility but the kernel's.
        for priority in [12, 14, 30, 191] {
            let written = driver.replacen('4', &priority.to_string(), 1);
            assert_eq!(parse_line(&written), None, "{written:?}");
        }
        let named =
            "12,7,9,-;NVRM: GPU at PCI:0000:e1:00: GPU-0a1b2c3d-0000-4000-8000-000000000007";
        assert_eq!(parse_line(named), None);
    }

    /// Only at the start of the message: after the record's header, a
    /// dmesg stamp, or nothing.
    #[test]
    fn the_drivers_words_count_only_where_a_message_starts() {
        for line in [
            "kernel: NVRM: Xid (PCI:0000:01:00): 79, GPU has fallen off the bus.",
            "4,1,2,-;x NVRM: Xid (PCI:0000:01:00): 79, y",
            "[  457.337975] comm[1]: NVRM: Xid (PCI:0000:01:00): 79, y",
            " NVRM: Xid (PCI:0000:01:00): 79, y",
            "NVRM: Xid (PCI:0000:01:00 ): 79, y",
            "NVRM: Xid (PCI:0000:01:000): 79, y",
            "NVRM: Xid (PCI:00:01:00): 79, y",
            "NVRM: Xid (PCI:0000:01:00): 79 y",
            "NVRM: Xid (PCI:0000:01:00 GPU-I:x): 13, y",
        ] {
            assert_eq!(parse_line(line), None, "{line:?}");
        }
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
        let real = include_str!("../../../../docs/device/h200-nvml/kmsg-nvrm.txt");
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

    proptest::proptest! {
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
