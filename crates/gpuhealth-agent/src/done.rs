//! What carrying out a request came to.

use gpuhealth_api::contract::Outcome;

/// How a reset or reboot ended, and why: what the executor writes back.
pub type Done = (Outcome, String);
