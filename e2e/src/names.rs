//! Names that no other test, and no earlier run against a reused cluster,
//! has used.

use std::{
    sync::atomic::{AtomicU32, Ordering},
    time::{SystemTime, UNIX_EPOCH},
};

static COUNTER: AtomicU32 = AtomicU32::new(0);

/// `prefix-xxxxxxxx`: a DNS label, unique per process and run.
pub fn unique(prefix: &str) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mix = nanos ^ std::process::id().rotate_left(16) ^ n.wrapping_mul(0x9E37_79B9);
    format!("{prefix}-{mix:08x}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn names_differ_and_are_dns_labels() {
        let a = super::unique("t");
        let b = super::unique("t");
        assert_ne!(a, b);
        assert!(
            a.len() <= 63
                && a.bytes()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
        );
    }
}
