//! Fault injection for the crash-safety tests, kept at the action boundary:
//! `GPUHEALTH_TEST_CRASH_AFTER=<phase>[:<node>]` makes the process exit
//! right after a decision that enters `phase` (for `node`, if named) is
//! recorded and before any of its actions, as a crash at the worst moment
//! would. Unset, it costs one comparison per decision.

use gpuhealth_api::node_health::Phase;
use tracing::error;

pub const ENV: &str = "GPUHEALTH_TEST_CRASH_AFTER";

/// Where to crash, if anywhere.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CrashAfter(Option<(Phase, Option<String>)>);

impl CrashAfter {
    /// From the environment; an unreadable value is refused at start.
    pub fn from_env() -> Result<Self, String> {
        let Ok(value) = std::env::var(ENV) else {
            return Ok(CrashAfter(None));
        };
        let (phase, node) = match value.split_once(':') {
            Some((p, n)) => (p.to_owned(), Some(n.to_owned())),
            None => (value.clone(), None),
        };
        let phase = serde_json::from_value::<Phase>(serde_json::Value::String(phase))
            .map_err(|_| format!("{ENV}: no phase in {value}"))?;
        Ok(CrashAfter(Some((phase, node))))
    }

    /// Exits if `node`'s recorded decision moved it from `from` into the
    /// phase named.
    pub fn before_acting(&self, node: &str, from: Phase, to: Phase) {
        let Some((at, only)) = &self.0 else {
            return;
        };
        if *at == to && from != to && only.as_ref().is_none_or(|n| n == node) {
            error!(node, phase = ?to, "{ENV}: exiting before carrying out the actions");
            std::process::exit(3);
        }
    }
}
