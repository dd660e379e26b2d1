//! What an Xid asks for. The defaults follow NVIDIA's Xid catalogue (see
//! DOMAIN.md); a policy's `xidOverrides` replace them code by code. Unknown
//! codes ask for nothing: the operator reports them and takes no action.

use gpuhealth_api::{policy::XidOverride, types::SignalAction};

/// How a code is treated when the policy does not override it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XidClass {
    /// An application fault: nothing for the node, unless it repeats.
    AppFault,
    /// Informational: nothing.
    Informational,
    /// The GPU needs the given action.
    Needs(SignalAction),
    /// Xid 154: the action is in the recovery-action value it carries.
    RecoveryActionChanged,
    /// Not in the table: reported, never acted on.
    Unknown,
}

/// App faults that repeat this often within [`APP_FAULT_WINDOW_SECS`] ask for a reset.
pub const APP_FAULT_REPEATS: usize = 3;
pub const APP_FAULT_WINDOW_SECS: i64 = 3600;

/// The built-in table.
pub fn default_class(code: u32) -> XidClass {
    use SignalAction::*;
    match code {
        13 | 31 | 32 | 68 | 69 | 94 => XidClass::AppFault,
        43 | 45 | 61 | 63 | 92 | 121 => XidClass::Informational,
        48 => XidClass::Needs(GpuReset),
        62 | 64 | 95 | 109 | 119 | 120 | 136 | 140 | 143 | 155 => XidClass::Needs(GpuReset),
        74 | 144..=150 => XidClass::Needs(GpuReset),
        79 => XidClass::Needs(NodeReboot),
        154 => XidClass::RecoveryActionChanged,
        _ => XidClass::Unknown,
    }
}

/// The class of `code` under a policy's overrides.
pub fn class(code: u32, overrides: &[XidOverride]) -> XidClass {
    match overrides.iter().find(|o| o.xid == code) {
        Some(o) => XidClass::Needs(o.action),
        None => default_class(code),
    }
}

/// The action a recovery-action value (NVML field 230, Xid 154) asks for.
/// Values newer than this table are treated as the strongest known action.
pub fn recovery_action(value: u32) -> SignalAction {
    match value {
        0 => SignalAction::Ignore,
        // 3 (drain P2P) and 4 (drain and reset) are served by draining the
        // affected pods and resetting.
        1 | 3 | 4 => SignalAction::GpuReset,
        _ => SignalAction::NodeReboot,
    }
}

/// The new recovery-action value in an Xid 154 message. Decided on the hex
/// value (`... to 0x1 (GPU Reset Required)`), since drivers from R610 on
/// changed the words; falls back to the words for lines that carry none
/// (`... from None to GPU Reset Required`).
pub fn recovery_action_in_text(text: &str) -> Option<u32> {
    let after_to = text.rsplit_once(" to ").map(|(_, rest)| rest.trim())?;
    if let Some(hex) = after_to
        .strip_prefix("0x")
        .or_else(|| after_to.strip_prefix("0X"))
    {
        let digits: String = hex.chars().take_while(char::is_ascii_hexdigit).collect();
        return u32::from_str_radix(&digits, 16).ok();
    }
    let words = after_to.to_ascii_lowercase();
    if words.starts_with("none") {
        Some(0)
    } else if words.contains("reboot") {
        Some(2)
    } else if words.contains("reset") || words.contains("flr") {
        Some(1)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_incident_codes() {
        assert_eq!(default_class(119), XidClass::Needs(SignalAction::GpuReset));
        assert_eq!(default_class(154), XidClass::RecoveryActionChanged);
        assert_eq!(default_class(79), XidClass::Needs(SignalAction::NodeReboot));
        assert_eq!(default_class(13), XidClass::AppFault);
        assert_eq!(default_class(4242), XidClass::Unknown);
    }

    #[test]
    fn overrides_win() {
        let o = [XidOverride {
            xid: 13,
            action: SignalAction::GpuReset,
        }];
        assert_eq!(class(13, &o), XidClass::Needs(SignalAction::GpuReset));
        assert_eq!(class(31, &o), XidClass::AppFault);
    }

    #[test]
    fn xid_154_text_variants() {
        let cases = [
            (
                "GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
                Some(1),
            ),
            (
                "GPU recovery action changed from 0x0 (None) to 0x2 (OS Reboot)",
                Some(2),
            ),
            (
                "GPU recovery action changed from 0x0 (None) to 0x1 (PF FLR)",
                Some(1),
            ),
            (
                "GPU recovery action changed from 0x1 (GPU Reset Required) to 0x0 (None)",
                Some(0),
            ),
            (
                "GPU recovery action changed from None to GPU Reset Required",
                Some(1),
            ),
            (
                "GPU recovery action changed from None to 0x7 (Future Action)",
                Some(7),
            ),
            ("garbage", None),
            ("to 0x", None),
        ];
        for (text, want) in cases {
            assert_eq!(recovery_action_in_text(text), want, "{text}");
        }
        assert_eq!(
            recovery_action(7),
            SignalAction::NodeReboot,
            "unknown values take the strongest known action"
        );
    }
}
