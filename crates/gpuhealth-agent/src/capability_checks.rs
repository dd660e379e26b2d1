//! What the report may claim the agent can do: each capability checked on
//! this node, not assumed from the flags. A reset needs NVML answering and
//! `nvidia-smi` that runs; a reboot, the chosen method's way there (logind
//! on the bus, kured's sentinel directory). The executor checks at start,
//! then again every few minutes, sooner while something fails, and offers
//! what it found to the reporter ([`Offering`], through
//! [`crate::handoff`]); the reporter's report says what stands
//! ([`Offered`]). A change is logged with its reason.

use std::time::Duration;

use gpuhealth_api::contract::{Capabilities, RebootMethod as Method};
use tokio::time::Instant;
use tracing::{info, warn};

use crate::{
    handoff::{self, Handoff, OFFER_STANDS, Offer, RENEW_OFFER},
    nvidia_smi::NvidiaSmi,
    reboot::RebootMethod,
};

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

/// The executor's checks, offered to the reporter: renewed each pass (the
/// offer lapses when the executor stops), and held for as long as a
/// request may take while it carries one out.
pub struct Offering {
    checks: CapabilityChecks,
    handoff: Handoff,
    renewed: Option<(Offer, Instant)>,
}

impl Offering {
    pub fn new(handoff: Handoff) -> Offering {
        Offering {
            checks: CapabilityChecks::default(),
            handoff,
            renewed: None,
        }
    }

    /// Checks again when due, and offers what stands when it changed or
    /// is due for renewal.
    pub async fn renew(&mut self, nvidia_smi: Option<&NvidiaSmi>, reboot: &RebootMethod) {
        self.checks.refresh(nvidia_smi, reboot).await;
        let offer = self.offer(reboot, OFFER_STANDS);
        let due = self.renewed.as_ref().is_none_or(|(last, at)| {
            (last.reset, &last.reboot, &last.withheld)
                != (offer.reset, &offer.reboot, &offer.withheld)
                || at.elapsed() >= RENEW_OFFER
        });
        if due {
            self.write(offer);
        }
    }

    /// Keeps the offer standing for `d` (a request being carried out).
    pub fn hold_for(&mut self, reboot: &RebootMethod, d: Duration) {
        let offer = self.offer(reboot, d);
        self.write(offer);
    }

    fn offer(&self, reboot: &RebootMethod, stands: Duration) -> Offer {
        let published = self.checks.published(true, reboot);
        Offer {
            reset: published.reset,
            reboot: published.reboot,
            withheld: self.checks.withheld(),
            until: handoff::after(stands),
        }
    }

    fn write(&mut self, offer: Offer) {
        match self.handoff.offer(&offer) {
            Ok(()) => self.renewed = Some((offer, Instant::now())),
            Err(e) => warn!(error = %e, "offering what this executor can carry out"),
        }
    }
}

/// What the reporter's report offers: what the executor's offer says,
/// while it stands; the reasons for anything withheld logged as they
/// change.
pub struct Offered {
    handoff: Handoff,
    now: Capabilities,
    withheld: Vec<String>,
}

impl Offered {
    pub fn new(handoff: Handoff) -> Offered {
        Offered {
            handoff,
            now: Capabilities {
                reset: false,
                reboot: Method::None,
            },
            withheld: Vec::new(),
        }
    }

    /// Reads the offer again; a reset only where NVML answers here too.
    pub fn refresh(&mut self, nvml_answers: bool) {
        let (now, withheld) = self.handoff.capabilities(nvml_answers);
        if withheld != self.withheld {
            for why in &withheld {
                warn!(%why, "the executor does not offer everything");
            }
            if withheld.is_empty() {
                info!(?now, "the executor offers everything it can");
            }
        }
        self.now = now;
        self.withheld = withheld;
    }

    pub fn capabilities(&self) -> Capabilities {
        self.now
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
