//! Running the real operator binary against the test cluster.

use std::time::Duration;

use crate::{Result, process::Process};

/// Leader-election timings for tests: short, so that a crashed leader's
/// successor does not keep a scenario waiting.
pub const LEASE_DURATION: Duration = Duration::from_secs(6);
pub const RETRY_PERIOD: Duration = Duration::from_secs(1);

/// How to start one replica.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// The leader Lease; replicas that share it elect one leader. Defaults
    /// to the replica's own name, so scenarios never wait on each other.
    pub lease: Option<String>,
    /// `GPUHEALTH_TEST_CRASH_AFTER`: exit right after recording this phase
    /// (`<phase>` or `<phase>:<node>`).
    pub crash_after: Option<String>,
    /// Run with this kubeconfig (a ServiceAccount's token) instead of the
    /// admin's.
    pub kubeconfig: Option<std::path::PathBuf>,
    /// `POD_NAMESPACE`: where its Lease lives.
    pub namespace: Option<String>,
    /// Where it runs validation pods (`GPUHEALTH_VALIDATION_NAMESPACE`).
    pub validation_namespace: Option<String>,
    /// `--log-format=json`, as the Deployment runs it.
    pub json_logs: bool,
    /// `RUST_LOG`; by default info, with the operator's debug lines.
    pub log: Option<String>,
    /// The operator's own leader-election timings instead of the tests'
    /// short ones (the benchmark counts the Lease's renewals).
    pub default_lease_timings: bool,
    /// Another release's binary to run instead of this build (the chaos
    /// run's upgrade scenario).
    pub binary: Option<std::path::PathBuf>,
    /// Check the admission protection (every this often) rather than act
    /// without it: the harness runs operators as cluster-admin on clusters
    /// without the install's admission policies, where it would find none.
    pub admission_check: Option<Duration>,
    /// The shipped guardrails, with these flags over them; None: no bound
    /// (the tests' fleets share one cluster, and the bench's policy is
    /// fleet-wide by design).
    pub guardrails: Option<Vec<String>>,
}

/// Starts `gpuhealth-operator` as replica `name` (`make e2e` builds it first).
pub async fn start(name: &str) -> Result<Process> {
    start_with(name, Options::default()).await
}

pub async fn start_with(name: &str, options: Options) -> Result<Process> {
    let secs = |d: Duration| format!("{}s", d.as_secs());
    let bin = options
        .binary
        .clone()
        .unwrap_or_else(|| crate::process::built("gpuhealth-operator"));
    Process::launch_from(bin, "gpuhealth-operator", name, |command| {
        command
            .env(
                "RUST_LOG",
                options.log.clone().unwrap_or_else(|| {
                    std::env::var("GPUHEALTH_E2E_OPERATOR_LOG")
                        .unwrap_or_else(|_| "info,gpuhealth_operator=debug,kube=warn".into())
                }),
            )
            .env("POD_NAME", name)
            .args(["--lease-name", options.lease.as_deref().unwrap_or(name)]);
        if !options.default_lease_timings {
            command
                .args(["--lease-duration", &secs(LEASE_DURATION)])
                .args(["--renew-deadline", &secs(LEASE_DURATION - 2 * RETRY_PERIOD)])
                .args(["--retry-period", &secs(RETRY_PERIOD)]);
        }
        if let Some(phase) = &options.crash_after {
            command.env("GPUHEALTH_TEST_CRASH_AFTER", phase);
        }
        match options.admission_check {
            Some(every) => {
                command.args(["--admission-check-interval", &secs(every)]);
            }
            // An environment variable, not the flag: the chaos run's
            // previous release knows no such flag.
            None => {
                command.env("GPUHEALTH_SKIP_ADMISSION_CHECK", "true");
            }
        }
        match &options.guardrails {
            Some(flags) => {
                command.args(flags);
            }
            // By environment, as above.
            None => {
                command
                    .env("GPUHEALTH_MAX_DISRUPTED_NODES", "100%")
                    .env("GPUHEALTH_FLEET_WIDE_NODES", "0")
                    .env("GPUHEALTH_CONDITION_TYPES", "*");
            }
        }
        if let Some(path) = &options.kubeconfig {
            command.env("KUBECONFIG", path);
        }
        if options.json_logs {
            command.arg("--log-format=json");
        }
        if let Some(namespace) = &options.namespace {
            command.env("POD_NAMESPACE", namespace);
        }
        if let Some(namespace) = &options.validation_namespace {
            command.env("GPUHEALTH_VALIDATION_NAMESPACE", namespace);
        }
    })
    .await
}
