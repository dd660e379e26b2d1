//! One step of an incident, as its history keeps it:
//! `status.history[].attempts[]`.

use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::words;
use crate::{RecoveryAction, contract::DiagnosticsResult};

words! {
    /// What was tried.
    pub enum AttemptAction {
        /// A rung of the ladder: reset the GPUs.
        GpuReset,
        /// A rung of the ladder: reboot the node.
        NodeReboot,
        /// A rung of the ladder: hand the node off for replacement.
        ReplaceNode,
        /// The policy's validation pod, after a rung succeeded.
        ValidationPod,
        /// DCGM's diagnostic on the repaired GPUs, after a rung succeeded.
        Diagnostics,
        /// A provider's scheduled maintenance.
        Maintenance,
    }
}

words! {
    /// How it went.
    pub enum AttemptOutcome {
        Succeeded,
        Failed,
        /// Did not finish in time.
        TimedOut,
        /// Passed over without being tried (`message` says why).
        Skipped,
        /// Abandoned while in flight (`message` says by whom).
        Cancelled,
        /// Handed to someone else (a replacement).
        Requested,
        /// The node was drained for it.
        Drained,
    }
}

impl From<RecoveryAction> for AttemptAction {
    fn from(a: RecoveryAction) -> Self {
        match a {
            RecoveryAction::GpuReset => AttemptAction::GpuReset,
            RecoveryAction::NodeReboot => AttemptAction::NodeReboot,
            RecoveryAction::ReplaceNode => AttemptAction::ReplaceNode,
        }
    }
}

impl AttemptAction {
    /// The rung of the ladder this is, if it is one.
    pub fn rung(self) -> Option<RecoveryAction> {
        match self {
            AttemptAction::GpuReset => Some(RecoveryAction::GpuReset),
            AttemptAction::NodeReboot => Some(RecoveryAction::NodeReboot),
            AttemptAction::ReplaceNode => Some(RecoveryAction::ReplaceNode),
            AttemptAction::ValidationPod
            | AttemptAction::Diagnostics
            | AttemptAction::Maintenance => None,
        }
    }
}

/// One step of an incident: `GpuReset` attempt 2 `Failed`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct Attempt {
    pub action: AttemptAction,
    /// 1-based attempt of this rung (for a validation pod: of the rung it validated).
    pub attempt: u32,
    pub outcome: AttemptOutcome,
    /// What else there is to say: why it was skipped, the validation pod's name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// A diagnostic's verdict on each test.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub diagnostics: Option<DiagnosticsResult>,
}

impl Attempt {
    pub fn new(action: impl Into<AttemptAction>, attempt: u32, outcome: AttemptOutcome) -> Self {
        Attempt {
            action: action.into(),
            attempt,
            outcome,
            message: None,
            diagnostics: None,
        }
    }

    pub fn saying(mut self, message: impl Into<String>) -> Self {
        self.message = Some(message.into());
        self
    }

    /// A rung of the ladder that was carried out and answered: what
    /// `gpuhealth_remediations_total` counts.
    pub fn is_remediation(&self) -> bool {
        self.action.rung().is_some()
            && matches!(
                self.outcome,
                AttemptOutcome::Succeeded | AttemptOutcome::Failed
            )
    }

    /// Reads an entry as release 0.1 wrote it, in words (`GpuReset#2
    /// Failed`, `validation pod NAME Succeeded`, ...). `rung_attempt` is the
    /// attempt of the last rung before it, which a validation pod's entry
    /// did not repeat. None for words 0.1 never wrote.
    pub fn from_words(entry: &str, rung_attempt: u32) -> Option<Attempt> {
        use AttemptOutcome::*;
        if let Some(rest) = entry.strip_prefix("validation pod ") {
            let (name, outcome) = rest.rsplit_once(' ')?;
            let outcome = [Succeeded, Failed, TimedOut]
                .into_iter()
                .find(|o| o.as_str() == outcome)?;
            return Some(
                Attempt::new(AttemptAction::ValidationPod, rung_attempt, outcome).saying(name),
            );
        }
        match entry {
            "drained for maintenance" => {
                return Some(Attempt::new(AttemptAction::Maintenance, 1, Drained));
            }
            "maintenance done (new boot id)" => {
                return Some(
                    Attempt::new(AttemptAction::Maintenance, 1, Succeeded).saying("new boot id"),
                );
            }
            "ReplaceNode requested" => {
                return Some(Attempt::new(AttemptAction::ReplaceNode, 1, Requested));
            }
            _ => {}
        }
        let (action, rest) = entry.split_once('#')?;
        let action = AttemptAction::ALL
            .iter()
            .copied()
            .find(|a| a.rung().is_some() && a.as_str() == action)?;
        let (attempt, rest) = rest.split_once(' ')?;
        let attempt = attempt.parse().ok()?;
        let attempt = Attempt::new(action, attempt, Succeeded);
        Some(match rest {
            "Succeeded" => attempt,
            "Failed" => Attempt {
                outcome: Failed,
                ..attempt
            },
            "Cancelled by hand" => Attempt {
                outcome: Cancelled,
                ..attempt
            }
            .saying("by hand"),
            _ => {
                let why = rest.strip_prefix("skipped: ")?;
                Attempt {
                    outcome: Skipped,
                    ..attempt
                }
                .saying(why)
            }
        })
    }
}

/// `GpuReset#2 Failed`, `GpuReset#1 Skipped: why`.
impl fmt::Display for Attempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#{} {}", self.action, self.attempt, self.outcome)?;
        match &self.message {
            Some(m) => write!(f, ": {m}"),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_every_entry_release_0_1_wrote() {
        let cases = [
            ("GpuReset#1 Succeeded", "GpuReset#1 Succeeded"),
            ("NodeReboot#2 Failed", "NodeReboot#2 Failed"),
            (
                "GpuReset#1 skipped: no GPU to name",
                "GpuReset#1 Skipped: no GPU to name",
            ),
            (
                "NodeReboot#1 Cancelled by hand",
                "NodeReboot#1 Cancelled: by hand",
            ),
            ("ReplaceNode requested", "ReplaceNode#1 Requested"),
            (
                "validation pod gpuhealth-validate-n-1 TimedOut",
                "ValidationPod#3 TimedOut: gpuhealth-validate-n-1",
            ),
            ("drained for maintenance", "Maintenance#1 Drained"),
            (
                "maintenance done (new boot id)",
                "Maintenance#1 Succeeded: new boot id",
            ),
        ];
        for (old, now) in cases {
            let read = Attempt::from_words(old, 3).unwrap_or_else(|| panic!("{old}"));
            assert_eq!(read.to_string(), now);
        }
    }

    #[test]
    fn words_never_written_are_not_guessed() {
        for other in [
            "GpuReset#x Failed",
            "Maintenance#1 Drained",
            "validation pod x Exploded",
            "GpuReset#1 Exploded",
            "",
        ] {
            assert_eq!(Attempt::from_words(other, 1), None, "{other}");
        }
    }

    #[test]
    fn only_answered_rungs_are_remediations() {
        use AttemptOutcome::*;
        assert!(Attempt::new(RecoveryAction::GpuReset, 1, Failed).is_remediation());
        assert!(Attempt::new(RecoveryAction::NodeReboot, 1, Succeeded).is_remediation());
        assert!(!Attempt::new(RecoveryAction::GpuReset, 1, Skipped).is_remediation());
        assert!(!Attempt::new(AttemptAction::ValidationPod, 1, Succeeded).is_remediation());
        assert!(!Attempt::new(RecoveryAction::ReplaceNode, 1, Requested).is_remediation());
    }
}
