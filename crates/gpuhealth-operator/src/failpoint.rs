//! Fault injection for the crash-safety tests, kept at the boundaries of
//! the record and act stages: `GPUHEALTH_TEST_CRASH_AFTER=<phase>[:<node>]`
//! makes the process exit right after a decision that enters `phase` (for
//! `node`, if named) is recorded and before any of its other actions, as a
//! crash at the worst moment would; `<phase>+fenced[:<node>]`, right after
//! its fence (the cordon or a GPU's rule) and before its status;
//! `<phase>+acted[:<node>]`, right after its actions, before the next
//! decision records what they did. Unset, it costs one comparison per
//! decision.

use gpuhealth_api::node_health::Phase;
use tracing::error;

pub const ENV: &str = "GPUHEALTH_TEST_CRASH_AFTER";

/// Where to crash, if anywhere: entering which phase, once it is recorded
/// or once its actions are carried out too, and on which node.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CrashAfter(Option<(Phase, Moment, Option<String>)>);

/// When, in the round that enters the phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Moment {
    /// Once the incident's fence is written, before its status.
    AfterFencing,
    BeforeActing,
    AfterActing,
}

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
        let (phase, moment) = if let Some(p) = phase.strip_suffix("+acted") {
            (p.to_owned(), Moment::AfterActing)
        } else if let Some(p) = phase.strip_suffix("+fenced") {
            (p.to_owned(), Moment::AfterFencing)
        } else {
            (phase, Moment::BeforeActing)
        };
        let phase = serde_json::from_value::<Phase>(serde_json::Value::String(phase))
            .map_err(|_| format!("{ENV}: no phase in {value}"))?;
        Ok(CrashAfter(Some((phase, moment, node))))
    }

    /// Exits if `node`'s recorded decision moved it from `from` into the
    /// phase named, at `moment`.
    pub fn at(&self, moment: Moment, node: &str, from: Phase, to: Phase) {
        let Some((at, when, only)) = &self.0 else {
            return;
        };
        if *at == to && *when == moment && from != to && only.as_ref().is_none_or(|n| n == node) {
            error!(node, phase = ?to, ?moment, "{ENV}: exiting");
            std::process::exit(3);
        }
    }
}
