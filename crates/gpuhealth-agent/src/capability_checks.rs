//! What the report may claim the agent can do: each capability checked on
//! this node, not assumed from the flags. A reset needs NVML answering,
//! `nvidia-smi` that runs, and the open files of a process outside the
//! executor's container readable (naming a GPU's holders reads every
//! process's, and a runtime's default AppArmor profile or SELinux type
//! forbids it); a reboot, the chosen method's way there (logind answering
//! on the bus, kured's sentinel directory). The executor checks at start,
//! then again every few minutes, sooner while something fails, and offers
//! what it found to the reporter ([`Offering`], through
//! [`crate::handoff`]); the reporter's report says what stands
//! ([`Offered`]). A change is logged with its reason; a check that starts
//! or stops failing is also said on the Node ([`crate::withheld`]).

use std::{collections::BTreeMap, path::Path, time::Duration};

use gpuhealth_api::contract::{Capabilities, RebootMethod as Method};
use tokio::time::Instant;
use tracing::{info, warn};

use crate::{
    handoff::{self, Handoff, OFFER_STANDS, Offer, RENEW_OFFER},
    holders,
    nvidia_smi::NvidiaSmi,
    reboot::RebootMethod,
};

/// How often a check that passed is made again.
const EVERY: Duration = Duration::from_secs(300);
/// How often a check that failed is made again.
const RETRY: Duration = Duration::from_secs(30);

/// What the executor may offer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Capability {
    Reset,
    Reboot,
}

impl Capability {
    /// The metric label, as `kind` is for requests.
    pub fn as_str(self) -> &'static str {
        match self {
            Capability::Reset => "reset",
            Capability::Reboot => "reboot",
        }
    }
}

/// A check a capability stands on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Check {
    /// `nvidia-smi -h` runs.
    NvidiaSmi,
    /// A host process's open files can be read ([`host_processes`]).
    HostProcesses,
    /// systemd-logind answers `CanReboot` over the system bus.
    Logind,
    /// kured's sentinel directory is there.
    KuredSentinel,
}

impl Check {
    pub const ALL: [Check; 4] = [
        Check::NvidiaSmi,
        Check::HostProcesses,
        Check::Logind,
        Check::KuredSentinel,
    ];

    /// The word for it in metrics and Events.
    pub fn as_str(self) -> &'static str {
        match self {
            Check::NvidiaSmi => "NvidiaSmi",
            Check::HostProcesses => "HostProcesses",
            Check::Logind => "Logind",
            Check::KuredSentinel => "KuredSentinel",
        }
    }

    /// What is withheld while it fails.
    pub fn capability(self) -> Capability {
        match self {
            Check::NvidiaSmi | Check::HostProcesses => Capability::Reset,
            Check::Logind | Check::KuredSentinel => Capability::Reboot,
        }
    }

    /// The check `method` stands on; none where it never reboots.
    pub fn of(method: &RebootMethod) -> Option<Check> {
        match method {
            RebootMethod::None => None,
            RebootMethod::Kured(_) => Some(Check::KuredSentinel),
            RebootMethod::Logind(_) => Some(Check::Logind),
        }
    }
}

impl std::fmt::Display for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a reset needs checked: `nvidia-smi`, and the node's processes
/// (`--proc-dir`) readable.
#[derive(Clone, Copy)]
pub struct ResetNeeds<'a> {
    pub nvidia_smi: &'a NvidiaSmi,
    pub proc: &'a Path,
}

/// Whether this executor can read the open files of `parent`, its
/// parent: the process that started its container (the runtime's shim),
/// a host process of root's with every capability and no container's
/// AppArmor profile or SELinux type, as the host's processes that may
/// hold a GPU are. The host's init would serve as well on a node, but is
/// out of every process's sight on the machine `make test` runs on, so
/// could never be shown passing there.
pub fn host_processes(proc: &Path, parent: u32) -> Result<(), String> {
    if parent == 0 {
        return Err(
            "this executor's parent is outside its PID namespace: its pod does not \
             share the host's (hostPID), so no host process that may hold a GPU is in its \
             sight (runbook GpuHealthCapabilityWithheld)"
                .into(),
        );
    }
    holders::read_open_files(proc, parent).map_err(|e| {
        format!(
            "{e}: the open files of {} (pid {parent}, which started this executor's container) \
             are out of its reach, and so would be those of a process holding a GPU: its \
             container's AppArmor profile or SELinux type, or a missing CAP_SYS_PTRACE \
             (runbook GpuHealthCapabilityWithheld)",
            holders::command(proc, parent)
        )
    })
}

/// The last results of the checks.
#[derive(Debug, Default)]
pub struct CapabilityChecks {
    next: Option<Instant>,
    /// Each check made at the last refresh, and what it found.
    results: BTreeMap<Check, Result<(), String>>,
}

impl CapabilityChecks {
    /// Checks again when it is time; `reset` is `None` where the backend
    /// never resets.
    pub async fn refresh(&mut self, reset: Option<ResetNeeds<'_>>, reboot: &RebootMethod) {
        if self.next.is_some_and(|at| Instant::now() < at) {
            return;
        }
        let mut now = BTreeMap::new();
        if let Some(needs) = reset {
            now.insert(Check::NvidiaSmi, needs.nvidia_smi.check().await);
            let parent = std::os::unix::process::parent_id();
            now.insert(Check::HostProcesses, host_processes(needs.proc, parent));
        }
        if let Some(check) = Check::of(reboot) {
            now.insert(check, reboot.check().await);
        }
        for (check, result) in &now {
            if self.results.get(check) == Some(result) {
                continue;
            }
            let capability = check.capability().as_str();
            match result {
                Ok(()) => info!(%check, capability, "the check passes: offered"),
                Err(why) => warn!(%check, capability, %why, "the check fails: not offered"),
            }
        }
        let failing = now.values().any(Result::is_err);
        self.next = Some(Instant::now() + if failing { RETRY } else { EVERY });
        self.results = now;
    }

    /// Each check made at the last refresh, and what it found.
    pub fn results(&self) -> impl Iterator<Item = (Check, &Result<(), String>)> {
        self.results.iter().map(|(check, result)| (*check, result))
    }

    /// Whether every check `capability` stands on was made and passed.
    fn passes(&self, capability: Capability) -> bool {
        let mut checks = self
            .results()
            .filter(|(check, _)| check.capability() == capability)
            .peekable();
        checks.peek().is_some() && checks.all(|(_, result)| result.is_ok())
    }

    /// Why each capability not offered is not, as the last checks said.
    pub fn withheld(&self) -> Vec<String> {
        let mut why = Vec::new();
        for (capability, what) in [
            (Capability::Reset, "no resets"),
            (Capability::Reboot, "no reboots"),
        ] {
            let checked = self.results().any(|(c, _)| c.capability() == capability);
            // A reboot method that needs no check has none to make.
            let unchecked = self.next.is_none() || (capability == Capability::Reset && !checked);
            if unchecked {
                why.push(format!("{what}: not checked"));
            }
            for (check, result) in self.results() {
                if let (true, Err(e)) = (check.capability() == capability, result) {
                    why.push(format!("{what}: {e}"));
                }
            }
        }
        why
    }

    /// What the report says: a reset only where NVML answered the last
    /// read and every reset check passed; the reboot method only where it
    /// can work.
    pub fn published(&self, nvml_answers: bool, reboot: &RebootMethod) -> Capabilities {
        Capabilities {
            reset: nvml_answers && self.passes(Capability::Reset),
            reboot: match Check::of(reboot) {
                Some(_) if self.passes(Capability::Reboot) => reboot.published(),
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
    pub async fn renew(&mut self, reset: Option<ResetNeeds<'_>>, reboot: &RebootMethod) {
        self.checks.refresh(reset, reboot).await;
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

    /// What the last checks found.
    pub fn checks(&self) -> &CapabilityChecks {
        &self.checks
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

    /// A `/proc` of no process: any process's open files unreadable.
    fn empty_proc(name: &str) -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("gpuhealth-checks-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        dir
    }

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
        assert_eq!(
            checks.withheld(),
            ["no resets: not checked", "no reboots: not checked"]
        );
        let smi = NvidiaSmi::Program("true".into());
        let reset = ResetNeeds {
            nvidia_smi: &smi,
            proc: Path::new("/proc"),
        };
        checks.refresh(Some(reset), &logind).await;
        assert_eq!(
            checks.published(true, &logind),
            Capabilities {
                reset: true,
                reboot: Method::None
            },
            "nvidia-smi runs, this process's parent is readable, the bus is not there"
        );
        assert!(
            !checks.published(false, &logind).reset,
            "no reset while NVML does not answer"
        );
        let mut checks = CapabilityChecks::default();
        let kured = RebootMethod::Kured(std::env::temp_dir().join("reboot-required"));
        let smi = NvidiaSmi::Program("/no/nvidia-smi".into());
        let reset = ResetNeeds {
            nvidia_smi: &smi,
            proc: Path::new("/proc"),
        };
        checks.refresh(Some(reset), &kured).await;
        assert_eq!(
            checks.published(true, &kured),
            Capabilities {
                reset: false,
                reboot: Method::Kured
            }
        );
    }

    /// nvidia-smi runs, but the host's processes cannot be read: no reset,
    /// and why, naming the check.
    #[tokio::test]
    async fn a_reset_is_withheld_while_the_hosts_processes_cannot_be_read() {
        let proc = empty_proc("unreadable");
        let smi = NvidiaSmi::Program("true".into());
        let mut checks = CapabilityChecks::default();
        checks
            .refresh(
                Some(ResetNeeds {
                    nvidia_smi: &smi,
                    proc: &proc,
                }),
                &RebootMethod::None,
            )
            .await;
        assert!(!checks.published(true, &RebootMethod::None).reset);
        let failing: Vec<Check> = checks
            .results()
            .filter(|(_, r)| r.is_err())
            .map(|(c, _)| c)
            .collect();
        assert_eq!(failing, [Check::HostProcesses]);
        let withheld = checks.withheld();
        assert_eq!(withheld.len(), 1, "{withheld:?}");
        assert!(
            withheld[0].starts_with("no resets: cannot list "),
            "{withheld:?}"
        );
        for said in ["CAP_SYS_PTRACE", "AppArmor", "GpuHealthCapabilityWithheld"] {
            assert!(withheld[0].contains(said), "{said} in {withheld:?}");
        }
    }

    #[test]
    fn a_parent_outside_the_pid_namespace_is_no_host_process() {
        let why = host_processes(Path::new("/proc"), 0).expect_err("no parent in sight");
        assert!(why.contains("hostPID"), "{why}");
        let proc = empty_proc("denied");
        std::fs::create_dir_all(proc.join("41/fd")).expect("fd");
        std::fs::write(proc.join("41/comm"), "containerd-shim\n").expect("comm");
        std::os::unix::fs::symlink(proc.join("gone"), proc.join("41/fd/0")).expect("an fd");
        let why = host_processes(&proc, 41).expect_err("denied");
        assert!(
            why.contains("containerd-shim (pid 41, which started this executor's container)"),
            "{why}"
        );
    }
}
