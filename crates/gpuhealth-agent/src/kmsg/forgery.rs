//! What a tenant can make the kernel print, read as the agent reads it.
//!
//! A process chooses its own name (`prctl(PR_SET_NAME)`, 15 bytes) and the
//! names of its files, and the kernel prints both when it crashes:
//! `NAME[PID]: segfault at ... in FILE[...]`, and more (`crash`).
//! Whatever they are, neither source the agent follows (a `/dev/kmsg`
//! record, or the `syslog(2)` buffer in a container that may not open
//! `/dev/kmsg`) may yield an Xid or a GPU's name from them.

use proptest::prelude::*;

use super::{
    crash::{crash_messages, kmsg_record, syslog_buffer},
    follow::syslog_records,
    parse::{KernelEvent, parse_line},
};

/// What the agent would take from `message`: every event either source
/// yields.
fn read_both_ways(message: &[u8]) -> Vec<KernelEvent> {
    let mut events: Vec<KernelEvent> = parse_line(&kmsg_record(message)).into_iter().collect();
    for (_, record) in syslog_records(&syslog_buffer(message)) {
        events.extend(parse_line(&record));
    }
    events
}

/// The driver's lines, and pieces of them, that a forger would reach for.
const DRIVER_WORDS: [&str; 6] = [
    "NVRM: Xid (",
    "NVRM: Xid (PCI:",
    "NVRM: GPU at PCI:",
    "0000:3b:00): 79, ",
    "PCI:0000:3b:00): 79, y",
    "NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.",
];

/// A process name: up to 15 bytes, none of them NUL; often a piece of the
/// driver's lines.
fn comm() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        proptest::collection::vec(1u8..=255, 0..=15),
        (proptest::sample::select(DRIVER_WORDS.to_vec()), 0usize..=15)
            .prop_map(|(w, cut)| { w.as_bytes()[..cut.min(w.len())].to_vec() }),
        (proptest::sample::select(DRIVER_WORDS.to_vec()), 0usize..=15).prop_map(|(w, skip)| {
            let b = w.as_bytes();
            b[skip.min(b.len())..].iter().copied().take(15).collect()
        }),
    ]
}

/// A file's name: 1 to 255 bytes, neither NUL nor `/`; often a driver line
/// after a newline, or the rest of one.
fn file() -> impl Strategy<Value = Vec<u8>> {
    let byte = (1u8..=255).prop_filter("not /", |b| *b != b'/');
    let driver_line = (0u32..0x10000, 0u8..=255, 0u8..=31, 0u32..200, "[ -~]{0,20}").prop_map(
        |(domain, bus, dev, code, text)| {
            format!("NVRM: Xid (PCI:{domain:04x}:{bus:02x}:{dev:02x}): {code}, {text}")
        },
    );
    prop_oneof![
        proptest::collection::vec(byte, 1..=255),
        (
            proptest::collection::vec(1u8..=255, 0..8),
            driver_line.clone()
        )
            .prop_map(|(before, line)| {
                let mut f: Vec<u8> = before.into_iter().filter(|b| *b != b'/').collect();
                f.push(b'\n');
                f.extend(line.bytes().filter(|b| *b != b'/'));
                f.truncate(255);
                f
            }),
        driver_line.prop_map(|l| {
            let mut f: Vec<u8> = l.bytes().filter(|b| *b != b'/').collect();
            f.truncate(255);
            f
        }),
        Just(b"x 0000:3b:00): 79, y".to_vec()),
    ]
}

#[test]
fn the_forgery_the_issue_reproduced_is_no_xid() {
    // As this project's build machine's kernel (6.18) printed it.
    for message in [
        "NVRM: Xid ([13327]: segfault at 0 ip 0000563bd2f01177 sp 00007fff8d2be480 error 6 in x 0000:3b:00): 79, y[1177,563bd2f01000+1000] likely on CPU 1 (core 1, socket 0)",
        "NVRM: Xid (PCI:[13329]: segfault at 0 ip 000055902073a177 sp 00007ffca6e1cb80 error 6 in z\nNVRM: Xid (PCI:0000:3b:00): 79, w[1177,55902073a000+1000] likely on CPU 1 (core 1, socket 0)",
    ] {
        assert_eq!(read_both_ways(message.as_bytes()), [], "{message:?}");
    }
}

#[test]
fn the_drivers_own_lines_read_both_ways() {
    // The harness finds what is there: the driver's line is an Xid through
    // either source.
    let events = read_both_ways(b"NVRM: Xid (PCI:0000:3b:00): 79, GPU has fallen off the bus.");
    let codes: Vec<u32> = events
        .iter()
        .map(|e| match e {
            KernelEvent::Xid(x) => x.code,
            KernelEvent::GpuAt { .. } => 0,
        })
        .collect();
    assert_eq!(codes, [79, 79]);
}

proptest! {
    #[test]
    fn a_crashing_process_never_writes_an_xid(comm in comm(), file in file()) {
        for message in crash_messages(&comm, &file) {
            let forged = read_both_ways(&message);
            prop_assert!(
                forged.is_empty(),
                "{:?} gave {forged:?}",
                String::from_utf8_lossy(&message)
            );
        }
    }
}
