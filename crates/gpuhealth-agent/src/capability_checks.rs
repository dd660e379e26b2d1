//! What the report may claim the agent can do: each capability checked on
//! this node, not assumed from the flags. A reset needs NVML answering and
//! `nvidia-smi` that runs; a reboot, the chosen method's way there (logind
//! on the bus, kured's sentinel directory). Checked at start, then again
//! every few minutes, sooner while something fails; a change is logged with
//! its reason.

use std::time::Duration;

use gpuhealth_api::contract::{Capabilities, RebootMethod as Method};
use tokio::time::Instant;
use tracing::{info, warn};

use crate::{nvidia_smi::NvidiaSmi, reboot::RebootMethod};

/// How often a check that passed is made again.
const EVERY: Duration = Duration::from_secs(300);
/// How often a check that failed is made again.
const RETRY: Duration = Duration::from_secs(30);

/// The last results of the checks.
#[derive(Debug, Default)]
pub struct CapabilityChecks {
    next: Option<Instant>,
    nvidia_smi: Option<Result<(), String>>,
    reboot: Option<Result<(), String>>,
}

impl CapabilityChecks {
    /// Checks again when it is time; `nvidia_smi` is `None` where the
    /// backend never resets.
    pub async fn refresh(&mut self, nvidia_smi: Option<&NvidiaSmi>, reboot: &RebootMethod) {
        if self.next.is_some_and(|at| Instant::now() < at) {
            return;
        }
        let smi = match nvidia_smi {
            Some(smi) => Some(smi.check().await),
            None => None,
        };
        let rebooting = reboot.check().await;
        if smi != self.nvidia_smi {
            match &smi {
                Some(Ok(())) => {
                    info!(nvidia_smi = %nvidia_smi.map(ToString::to_string).unwrap_or_default(), "nvidia-smi runs: resets are offered")
                }
                Some(Err(why)) => {
                    warn!(%why, "nvidia-smi does not run here: no resets are offered")
                }
                None => {}
            }
        }
        if Some(&rebooting) != self.reboot.as_ref() {
            match &rebooting {
                Ok(()) => info!(method = ?reboot.published(), "reboots are offered"),
                Err(why) => {
                    warn!(%why, method = ?reboot.published(), "this reboot method cannot work here: no reboots are offered")
                }
            }
        }
        let failing = smi.as_ref().is_some_and(Result::is_err) || rebooting.is_err();
        self.next = Some(Instant::now() + if failing { RETRY } else { EVERY });
        self.nvidia_smi = smi;
        self.reboot = Some(rebooting);
    }

    /// Why each capability not offered is not, as the last checks said.
    pub fn withheld(&self) -> Vec<String> {
        [
            ("no resets", &self.nvidia_smi),
            ("no reboots", &self.reboot),
        ]
        .into_iter()
        .filter_map(|(what, result)| match result {
            Some(Err(why)) => Some(format!("{what}: {why}")),
            None => Some(format!("{what}: not checked")),
            Some(Ok(())) => None,
        })
        .collect()
    }

    /// What the report says: a reset only where NVML answered the last
    /// read and `nvidia-smi` runs; the reboot method only where it can work.
    pub fn published(&self, nvml_answers: bool, reboot: &RebootMethod) -> Capabilities {
        Capabilities {
            reset: nvml_answers && matches!(self.nvidia_smi, Some(Ok(()))),
            reboot: match self.reboot {
                Some(Ok(())) => reboot.published(),
                _ => Method::None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn only_what_was_checked_is_offered() {
        let mut checks = CapabilityChecks::default();
        let logind = RebootMethod::Logind("unix:path=/no/such/bus".into());
        // Nothing checked yet: nothing offered.
        assert_eq!(
            checks.published(true, &logind),
            Capabilities {
                reset: false,
                reboot: Method::None
            }
        );
        checks
            .refresh(Some(&NvidiaSmi::Program("true".into())), &logind)
            .await;
        assert_eq!(
            checks.published(true, &logind),
            Capabilities {
                reset: true,
                reboot: Method::None
            },
            "nvidia-smi runs, the bus is not there"
        );
        assert!(
            !checks.published(false, &logind).reset,
            "no reset while NVML does not answer"
        );
        let mut checks = CapabilityChecks::default();
        let kured = RebootMethod::Kured(std::env::temp_dir().join("reboot-required"));
        checks
            .refresh(Some(&NvidiaSmi::Program("/no/nvidia-smi".into())), &kured)
            .await;
        assert_eq!(
            checks.published(true, &kured),
            Capabilities {
                reset: false,
                reboot: Method::Kured
            }
        );
    }
}
