//! What each fuzz target checks, beyond "never panics": a value the
//! contract accepts serialises to one it accepts again, unchanged; the
//! kernel log stays within its bounds whatever it is fed.

use gpuhealth_agent::kmsg::{
    GPUS_TRACKED, KernelLog, XIDS_PER_GPU,
    crash::{crash_messages, kmsg_record, syslog_buffer},
    parse_line, syslog_records,
};
use gpuhealth_api::contract::{
    AnnotationValue, CordonRecord, GpuReport, MaintenanceNotice, RebootRequest, RequestResult,
    ResetRequest,
};
use k8s_openapi::jiff::Timestamp;

/// Parses `data` as `T`; what parses must serialise to a value that
/// parses again and serialises the same. (Not equal to the first value:
/// times are written to the second, as Kubernetes writes them, so a
/// fraction a producer wrote is dropped on the way back; the first fuzz runs
/// found that.)
pub fn round_trip<T: AnnotationValue + std::fmt::Debug>(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(value) = T::parse(text) {
        let written = value.to_annotation();
        let again = T::parse(&written);
        assert!(again.is_ok(), "{value:?} written as {written} is refused: {again:?}");
        let rewritten = again.as_ref().map(AnnotationValue::to_annotation).ok();
        assert_eq!(rewritten.as_deref(), Some(written.as_str()));
    }
}

pub fn gpu_report(data: &[u8]) {
    round_trip::<GpuReport>(data);
}

/// The first byte picks which request annotation the rest is.
pub fn requests(data: &[u8]) {
    let Some((which, rest)) = data.split_first() else {
        return;
    };
    match which % 4 {
        0 => round_trip::<ResetRequest>(rest),
        1 => round_trip::<RebootRequest>(rest),
        2 => round_trip::<RequestResult>(rest),
        _ => round_trip::<CordonRecord>(rest),
    }
}

pub fn maintenance(data: &[u8]) {
    round_trip::<MaintenanceNotice>(data);
}

/// Each line of `data` into one kernel log, a second apart; what it
/// reports stays within the report's bounds. And `data` cut into a
/// process's name (its first 15 bytes) and a file's (the rest): no crash
/// message of the kernel's that names them is a GPU line, read from
/// `/dev/kmsg` or through `syslog(2)`.
pub fn kernel_log(data: &[u8]) {
    let (comm, file) = data.split_at(data.len().min(15));
    let comm: Vec<u8> = comm.iter().copied().filter(|b| *b != 0).collect();
    let file: Vec<u8> = file.iter().copied().filter(|b| ![0, b'/'].contains(b)).collect();
    for message in crash_messages(&comm, &file) {
        let record = kmsg_record(&message);
        assert_eq!(parse_line(&record), None, "{record:?}");
        for (_, record) in syslog_records(&syslog_buffer(&message)) {
            assert_eq!(parse_line(&record), None, "{record:?}");
        }
    }

    let text = String::from_utf8_lossy(data);
    let mut log = KernelLog::default();
    for (i, line) in text.lines().enumerate() {
        let at = Timestamp::from_second(i as i64).unwrap_or(Timestamp::UNIX_EPOCH);
        log.take(line, at);
    }
    let entries = log.entries(Timestamp::UNIX_EPOCH);
    assert!(entries.len() <= GPUS_TRACKED);
    for gpu in &entries {
        assert!(gpu.xids.len() <= XIDS_PER_GPU, "{gpu:?}");
    }
}
