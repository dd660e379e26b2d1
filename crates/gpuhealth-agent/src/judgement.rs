//! How healthy a GPU is, from what was seen of it. NVML's readings
//! ([`crate::nvml::health`]) and the kernel log
//! ([`crate::kmsg::KernelLog::entries`]) are both judged here, so that the
//! same signal means the same health whichever source saw it.
//!
//! Signals add up to the most severe health any of them calls for:
//! [`GpuHealth`]'s own order is by severity, mildest first.

use gpuhealth_api::{
    GpuHealth,
    contract::{RemappedRows, XidEvent},
    types::SignalAction,
};
use gpuhealth_engine::xid::{XidClass, default_class, recovery_action};

/// The most severe of `healths`; healthy when there are none.
pub fn worst(healths: impl IntoIterator<Item = GpuHealth>) -> GpuHealth {
    healths.into_iter().max().unwrap_or(GpuHealth::Healthy)
}

/// The health a signal's action calls for.
fn of_action(action: SignalAction) -> GpuHealth {
    match action {
        SignalAction::GpuReset => GpuHealth::ResetRequired,
        SignalAction::NodeReboot | SignalAction::ReplaceNode => GpuHealth::RebootRequired,
        SignalAction::Ignore => GpuHealth::Healthy,
    }
}

/// The health a recovery-action value calls for: NVML's field 230, or the
/// value an Xid 154 announced in the kernel log.
pub fn of_recovery_action(value: u32) -> GpuHealth {
    of_action(recovery_action(value))
}

/// The health logged Xids call for: the strongest action any of them asks
/// for, the newest recovery action standing for Xid 154. App faults and
/// unknown codes are the operator's to judge (they count repeats over
/// time), so alone they leave the GPU healthy; so does an Xid NVML did not
/// confirm.
pub fn of_xids(xids: &[XidEvent], recovery_action: Option<u32>) -> GpuHealth {
    let believed = xids.iter().filter(|x| !x.uncorroborated);
    let by_code = believed.filter_map(|x| match default_class(x.code) {
        XidClass::Needs(action) => Some(of_action(action)),
        _ => None,
    });
    worst(by_code.chain(recovery_action.map(of_recovery_action)))
}

/// The health the GPU's memory calls for. What a GPU cannot tell (`None`)
/// is not held against it.
pub fn of_memory(
    remapped_rows: Option<RemappedRows>,
    retired_pages_pending: Option<bool>,
    uncorrected_ecc_volatile: Option<u64>,
) -> GpuHealth {
    let rows = remapped_rows.unwrap_or(RemappedRows {
        pending: false,
        failure: false,
    });
    // nvidia-smi shows a remapping failure as "GPU requires reset".
    if rows.failure {
        GpuHealth::ResetRequired
    } else if rows.pending
        || retired_pages_pending == Some(true)
        || uncorrected_ecc_volatile.is_some_and(|n| n > 0)
    {
        GpuHealth::Degraded
    } else {
        GpuHealth::Healthy
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};

    use super::*;

    /// [`worst`] leans on `GpuHealth`'s derived order: were its variants
    /// reordered, a GPU that needs a reboot could be reported as one that
    /// needs a reset.
    #[test]
    fn health_is_ordered_by_severity() {
        use GpuHealth::*;
        let mildest_first = [Healthy, Degraded, ResetRequired, RebootRequired, Lost];
        assert!(mildest_first.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(worst(mildest_first.iter().rev().copied()), Lost);
        assert_eq!(
            worst([Degraded, RebootRequired, ResetRequired]),
            RebootRequired
        );
        assert_eq!(worst([]), Healthy);
    }

    #[test]
    fn xids_and_the_recovery_action_are_one_judgement() {
        let xid = |code| XidEvent::new(code, Time(Timestamp::UNIX_EPOCH), "");
        // An app fault and an unknown code alone: the operator's to judge.
        assert_eq!(of_xids(&[xid(13), xid(4242)], None), GpuHealth::Healthy);
        assert_eq!(of_xids(&[xid(48)], None), GpuHealth::ResetRequired);
        assert_eq!(
            of_xids(&[xid(79), xid(48)], None),
            GpuHealth::RebootRequired
        );
        // Xid 154 itself asks nothing; the value it announced does, as the
        // same value read from NVML would.
        assert_eq!(of_xids(&[xid(154)], None), GpuHealth::Healthy);
        for value in [0, 1, 2, 3, 4, 7] {
            assert_eq!(
                of_xids(&[xid(154)], Some(value)),
                of_recovery_action(value),
                "recovery action {value}"
            );
        }
        assert_eq!(of_xids(&[xid(48)], Some(2)), GpuHealth::RebootRequired);
        assert_eq!(of_xids(&[xid(79)], Some(0)), GpuHealth::RebootRequired);
    }
}
