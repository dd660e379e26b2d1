//! Following the kernel log on threads of their own: `/dev/kmsg` or a plain
//! file read as it grows, or, where `/dev/kmsg` may not be opened, the ring
//! buffer through `syslog(2)` (the crate `gpuhealth-klog`). Each line is
//! handed on with when it was logged; what it says of a GPU is not read here.

use std::{
    io::{BufRead, BufReader},
    path::PathBuf,
};

use k8s_openapi::jiff::{SignedDuration, Timestamp};

use super::parse::kmsg_timestamp;

/// The longest line taken in: a kernel log record is at most about 1 KiB;
/// a plain file may hold anything.
pub const MAX_LINE: usize = 4096;

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

/// Cuts `line` to at most `max` bytes, at a character's boundary: a
/// record's text is whatever the kernel was given, and `String::truncate`
/// inside a character panics.
fn cut(line: &mut String, max: usize) {
    if line.len() > max {
        let end = (0..=max)
            .rev()
            .find(|&i| line.is_char_boundary(i))
            .unwrap_or(0);
        line.truncate(end);
    }
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

/// One `syslog(2)` line, `<PRIORITY>[SECONDS.MICROS] MESSAGE`: its
/// priority, its time and its message; `None` without a timestamp
/// (`printk.time=0`), which could not be told from a repeat.
fn syslog_line(line: &str) -> Option<(u32, u64, &str)> {
    let (priority, rest) = line.strip_prefix('<')?.split_once('>')?;
    let (stamp, message) = rest.strip_prefix('[')?.split_once(']')?;
    let (secs, micros) = stamp.trim().split_once('.')?;
    let us = secs.parse::<u64>().ok()?.checked_mul(1_000_000)? + micros.parse::<u64>().ok()?;
    let priority: u32 = priority.parse().ok()?;
    Some((priority, us, message.strip_prefix(' ').unwrap_or(message)))
}

/// The first line of each record in a read of the whole buffer, as the
/// `/dev/kmsg` record the rest of this module reads, with its time.
///
/// `syslog(2)` writes each line of a record that holds a newline as a line
/// of its own, under the record's own priority and time, where
/// `/dev/kmsg` escapes the newline (`\x0a`). A tenant's process names its
/// own files, and the kernel prints the name of the one a crash was in:
/// a file named `x` + newline + `NVRM: Xid (PCI:…): 79, …` makes a line
/// that reads as the driver's own. So a line with the same priority and
/// time as the one before continues that record, and is passed over (as
/// is, with it, a second record logged in the same microsecond at the
/// same priority: NVML's events still carry its Xid).
pub fn syslog_records(buffer: &str) -> impl Iterator<Item = (u64, String)> + '_ {
    let mut before = None;
    buffer.lines().filter_map(move |line| {
        let (priority, us, message) = syslog_line(line)?;
        let continues = before == Some((priority, us));
        before = Some((priority, us));
        (!continues).then(|| (us, format!("{priority},0,{us},-;{message}")))
    })
}

/// The records in a read of the whole buffer that `cursor` has not taken
/// yet, oldest first; moves the cursor past them.
fn unread(buffer: &str, cursor: &mut Cursor) -> Vec<(u64, String)> {
    let mut out = Vec::new();
    let mut same = 0;
    let mut last = cursor.last;
    for (us, record) in syslog_records(buffer) {
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
                cut(&mut record, MAX_LINE);
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
    use super::{
        super::parse::{KernelEvent, parse_line},
        *,
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
            "{first}<5>[  100.250000] third at that time\n<6>[  101.000000] later\nno time\n"
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

    /// `syslog(2)` writes a record holding a newline as lines under the
    /// same priority and time (seen on this project's build machine, a
    /// 6.18 kernel, with `dmesg -S -r`): the lines after the first are not
    /// records of their own.
    #[test]
    fn the_lines_after_a_records_first_continue_it() {
        let buffer = concat!(
            "<4>[  100.000000] NVRM: Xid (PCI:0000:e1:00): 48, DBE\n",
            "<6>[  457.349948] NVRM: Xid (PCI:[13329]: segfault at 0 ip 000055902073a177 sp 00007ffca6e1cb80 error 6 in z\n",
            "<6>[  457.349948] NVRM: Xid (PCI:0000:3b:00): 79, w[1177,55902073a000+1000] likely on CPU 1 (core 1, socket 0)\n",
            "<6>[  457.349972] Code: 1d 48 8b 45\n",
        );
        let mut cursor = Cursor::default();
        let read = unread(buffer, &mut cursor);
        let said: Vec<&str> = read
            .iter()
            .map(|(_, r)| r.split_once(';').map_or("", |(_, m)| m))
            .collect();
        assert_eq!(said.len(), 3, "{said:?}");
        assert!(said[1].contains("segfault"), "{said:?}");
        let xids: Vec<u32> = read
            .iter()
            .filter_map(|(_, r)| match parse_line(r) {
                Some(KernelEvent::Xid(x)) => Some(x.code),
                _ => None,
            })
            .collect();
        assert_eq!(xids, [48], "only the driver's own line");
        assert!(unread(buffer, &mut cursor).is_empty(), "nothing twice");
    }

    /// Found for issue 9: a kernel log line was read whole, however long; a
    /// file with no newline in it grew the agent without bound.
    #[test]
    fn a_long_record_is_cut_between_characters() {
        // "é" is two bytes: the cut at MAX_LINE falls inside one.
        let mut line = format!("x{}", "é".repeat(MAX_LINE));
        cut(&mut line, MAX_LINE);
        assert_eq!(line.len(), MAX_LINE - 1);
        assert!(line.ends_with('é'));
        let mut short = "NVRM: Xid 79".to_owned();
        cut(&mut short, MAX_LINE);
        assert_eq!(short, "NVRM: Xid 79");
    }

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
}
