//! The kernel log: `NVRM: Xid` lines and the driver's PCI → UUID lines. It
//! catches what happened before NVML events were registered, and stands in
//! for NVML where NVML cannot be loaded.
//!
//! One job a module, each using only those before it:
//! - `parse`: what one line says;
//! - `store`: what the log has said about each GPU so far;
//! - `follow`: reading `/dev/kmsg`, a file or `syslog(2)` as it grows;
//! - `feed`: the lines read and NVML's Xid events into the
//!   store, and a wake-up for each new Xid.
//!
//! `crash` says what the kernel prints of a crashing process, which a
//! tenant shapes: the tests (`forgery`) and the fuzz target hold the
//! parser to never reading an Xid there.
//!
//! What a GPU's health is, given its Xids, is judged in [`crate::judgement`],
//! with NVML's readings.

pub mod crash;
mod feed;
mod follow;
#[cfg(test)]
mod forgery;
mod parse;
mod store;

pub use feed::Feed;
pub use follow::{MAX_LINE, follow, follow_syslog, syslog_records};
pub use parse::{KernelEvent, PciAddress, XidLine, parse_line};
pub use store::{GPUS_TRACKED, KernelLog, XIDS_PER_GPU};
