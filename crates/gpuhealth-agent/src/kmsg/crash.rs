//! What the kernel prints when a process crashes, as the agent would read
//! it: for the tests and the fuzz target that hold the kernel log's parser
//! to never reading an Xid into it (`forgery.rs`, `fuzz/`).
//!
//! A process chooses its own name (`prctl(PR_SET_NAME)`, 15 bytes) and the
//! names of its files, and the kernel prints both.

/// The shapes of the kernel's crash messages that start with, or carry, a
/// process's name and a file's (x86's `show_signal_msg` and traps, arm64's
/// unhandled faults), as of 6.x.
pub fn crash_messages(comm: &[u8], file: &[u8]) -> Vec<Vec<u8>> {
    let vma = [b" in ".as_slice(), file, b"[1177,55902073a000+1000]"].concat();
    vec![
        [
            comm,
            b"[13329]: segfault at 0 ip 000055902073a177 sp 00007ffca6e1cb80 error 6",
            &vma,
            b" likely on CPU 1 (core 1, socket 0)",
        ]
        .concat(),
        [
            comm,
            b"[13329]: segfault at 0 ip 000055902073a177 sp 00007ffca6e1cb80 error 4",
        ]
        .concat(),
        [
            b"traps: ",
            comm,
            b"[13329] general protection fault ip:55902073a177 sp:7ffca6e1cb80 error:0",
            &vma,
        ]
        .concat(),
        [
            b"traps: ",
            comm,
            b"[13329] trap int3 ip:55902073a177 sp:7ffca6e1cb80 error:0",
            &vma,
        ]
        .concat(),
        [
            comm,
            b"[13329]: unhandled level 1 translation fault (11) at 0x00000000, esr 0x92000045, in ",
            file,
            b"[55902073a000+1000]",
        ]
        .concat(),
    ]
}

/// A `/dev/kmsg` record of the kernel's (facility 0, level 6), as the
/// device writes it: every byte outside printable ASCII, and `\`, escaped.
pub fn kmsg_record(message: &[u8]) -> String {
    let mut out = String::from("6,340,457349948,-;");
    for &b in message {
        if !(b' '..0x7f).contains(&b) || b == b'\\' {
            out.push_str(&format!("\\x{b:02x}"));
        } else {
            out.push(char::from(b));
        }
    }
    out
}

/// What `syslog(2)` gives for the same record after an earlier one: each
/// line of the record under the record's priority and time.
pub fn syslog_buffer(message: &[u8]) -> String {
    let text = String::from_utf8_lossy(message);
    let mut out = String::from("<6>[  100.000000] an earlier record\n");
    for line in text.split('\n') {
        out.push_str(&format!("<6>[  457.349948] {line}\n"));
    }
    out
}
