//! The kernel's ring buffer through `syslog(2)` (glibc's `klogctl`): how a
//! process with CAP_SYSLOG reads the kernel log where it may not open
//! `/dev/kmsg` (a container that is not privileged: its device cgroup
//! refuses the device). Read whole and left as it is, so that no other
//! reader of the log loses a line.

/// `SYSLOG_ACTION_READ_ALL`: read the buffer, leaving it as it is.
const READ_ALL: libc::c_int = 3;
/// `SYSLOG_ACTION_SIZE_BUFFER`: the buffer's size.
const SIZE_BUFFER: libc::c_int = 10;

/// The whole ring buffer, a line per record (`<PRIORITY>[SECONDS] TEXT`),
/// read into `buffer` (grown to the kernel's buffer size) and returned as
/// text. An error (EPERM without CAP_SYSLOG) as the kernel gives it.
pub fn read_all(buffer: &mut Vec<u8>) -> std::io::Result<String> {
    // SAFETY: SIZE_BUFFER takes no buffer: a null pointer of length 0.
    let size = unsafe { libc::klogctl(SIZE_BUFFER, std::ptr::null_mut(), 0) };
    let size = usize::try_from(size).map_err(|_| std::io::Error::last_os_error())?;
    buffer.resize(size, 0);
    let len = libc::c_int::try_from(buffer.len()).unwrap_or(libc::c_int::MAX);
    // SAFETY: the kernel writes at most `len` bytes, and `buffer` holds that many.
    let read = unsafe { libc::klogctl(READ_ALL, buffer.as_mut_ptr().cast(), len) };
    let read = usize::try_from(read).map_err(|_| std::io::Error::last_os_error())?;
    Ok(String::from_utf8_lossy(&buffer[..read.min(buffer.len())]).into_owned())
}

#[cfg(test)]
mod tests {
    /// Whether this process holds CAP_SYSLOG (bit 34 of CapEff).
    fn holds_cap_syslog() -> bool {
        let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
        let eff = status
            .lines()
            .find_map(|l| l.strip_prefix("CapEff:"))
            .expect("CapEff");
        u64::from_str_radix(eff.trim(), 16).expect("a capability set") & (1 << 34) != 0
    }

    /// The kernel's own rule: the buffer for a holder of CAP_SYSLOG, and
    /// for anyone while `kernel.dmesg_restrict` is 0; EPERM otherwise.
    #[test]
    fn the_buffer_is_read_exactly_where_the_kernel_allows_it() {
        let restricted = std::fs::read_to_string("/proc/sys/kernel/dmesg_restrict")
            .map(|v| v.trim() != "0")
            .unwrap_or(true);
        let allowed = holds_cap_syslog() || !restricted;
        let mut buffer = Vec::new();
        match super::read_all(&mut buffer) {
            Ok(text) => {
                assert!(allowed, "read without CAP_SYSLOG under dmesg_restrict");
                assert!(text.len() <= buffer.len());
            }
            Err(e) => {
                assert!(!allowed, "refused though allowed: {e}");
                assert_eq!(e.raw_os_error(), Some(libc::EPERM), "{e}");
            }
        }
    }
}
