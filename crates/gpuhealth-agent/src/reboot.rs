//! How the agent reboots its node.
//!
//! The shipped way asks systemd-logind over the host's system D-Bus socket
//! (`/run/dbus/system_bus_socket`, mounted from the host, its address given
//! explicitly: a minimal image has no `/var/run` link to find the standard
//! one through): the call `systemctl reboot` makes, with no binary in the
//! image and no host PID namespace, and a clean shutdown that honours
//! logind's inhibitors (the kubelet's graceful node shutdown among them).
//! logind lets a caller with `CAP_SYS_BOOT` reboot without asking polkit.

use std::{path::PathBuf, time::Duration};

use gpuhealth_api::contract::{Outcome, RebootMethod as Method};

use crate::done::Done;

/// How long the bus gets to answer.
const BUS_DEADLINE: Duration = Duration::from_secs(30);

#[derive(Clone, Debug)]
pub enum RebootMethod {
    /// Refuse: a person or another tool reboots.
    None,
    /// Create kured's sentinel file; kured reboots under its own lock.
    Kured(PathBuf),
    /// `org.freedesktop.login1.Manager.Reboot` on the system bus at this
    /// D-Bus address (`unix:path=...`).
    Logind(String),
}

/// The host's system bus where the shipped manifest mounts it.
pub const SYSTEM_BUS: &str = "unix:path=/run/dbus/system_bus_socket";

impl RebootMethod {
    /// What the report says of it.
    pub fn published(&self) -> Method {
        match self {
            RebootMethod::None => Method::None,
            RebootMethod::Kured(_) => Method::Kured,
            RebootMethod::Logind(_) => Method::Logind,
        }
    }

    /// Whether this method can work here now, or why not: kured's sentinel
    /// can be created where it is asked for, or logind, asked over the bus
    /// whether it would reboot for this caller (`CanReboot`, which reboots
    /// nothing), says yes.
    pub async fn check(&self) -> Result<(), String> {
        match self {
            RebootMethod::None => Ok(()),
            RebootMethod::Kured(path) => match path.parent() {
                Some(dir) if dir.is_dir() => Ok(()),
                _ => Err(format!(
                    "kured's sentinel {}: its directory is not there (mount the host's)",
                    path.display()
                )),
            },
            RebootMethod::Logind(bus) => {
                match tokio::time::timeout(BUS_DEADLINE, logind_can_reboot(bus)).await {
                    Ok(Ok(answer)) if answer == "yes" => Ok(()),
                    Ok(Ok(answer)) => Err(format!(
                        "systemd-logind on the system bus {bus} answers CanReboot with {answer:?}, \
                         not \"yes\": it would not reboot for this executor without asking \
                         (CAP_SYS_BOOT, or polkit)"
                    )),
                    Ok(Err(e)) => Err(format!(
                        "systemd-logind over the system bus {bus}: {e} (is the bus mounted, and \
                         may this container reach it? runbook GpuHealthCapabilityWithheld)"
                    )),
                    Err(_) => Err(format!(
                        "systemd-logind over the system bus {bus} did not answer within {BUS_DEADLINE:?}"
                    )),
                }
            }
        }
    }

    pub async fn reboot(&self) -> Done {
        match self {
            RebootMethod::None => (
                Outcome::Refused,
                "this agent does not reboot (--reboot-method none)".into(),
            ),
            RebootMethod::Kured(path) => match std::fs::File::create(path) {
                Ok(_) => (
                    Outcome::Succeeded,
                    format!("created kured's sentinel {}", path.display()),
                ),
                Err(e) => (Outcome::Failed, format!("creating {}: {e}", path.display())),
            },
            RebootMethod::Logind(bus) => match tokio::time::timeout(
                BUS_DEADLINE,
                logind_reboot(bus),
            )
            .await
            {
                Ok(Ok(())) => (
                    Outcome::Succeeded,
                    "systemd-logind accepted the reboot (org.freedesktop.login1.Manager.Reboot)"
                        .into(),
                ),
                Ok(Err(e)) => (
                    Outcome::Failed,
                    format!("asking systemd-logind to reboot: {e}"),
                ),
                Err(_) => (
                    Outcome::Failed,
                    format!("the system bus did not answer within {BUS_DEADLINE:?}"),
                ),
            },
        }
    }
}

async fn connect(address: &str) -> zbus::Result<zbus::Connection> {
    zbus::connection::Builder::address(address).build().await
}

/// What systemd-logind answers `CanReboot`: `yes`, `challenge` (it would
/// ask polkit), `no` or `na`. A call to logind itself, not the bus's own
/// name service, so that a bus policy or a security module that keeps
/// this container from logind fails it.
async fn logind_can_reboot(address: &str) -> zbus::Result<String> {
    let bus = connect(address).await?;
    let reply = bus
        .call_method(
            Some("org.freedesktop.login1"),
            "/org/freedesktop/login1",
            Some("org.freedesktop.login1.Manager"),
            "CanReboot",
            &(),
        )
        .await?;
    reply.body().deserialize::<String>()
}

async fn logind_reboot(address: &str) -> zbus::Result<()> {
    let bus = connect(address).await?;
    // `interactive` false: never wait for a password prompt.
    bus.call_method(
        Some("org.freedesktop.login1"),
        "/org/freedesktop/login1",
        Some("org.freedesktop.login1.Manager"),
        "Reboot",
        &(false,),
    )
    .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn each_method_answers_as_it_should() {
        let (outcome, why) = RebootMethod::None.reboot().await;
        assert_eq!(outcome, Outcome::Refused);
        assert!(why.contains("--reboot-method none"), "{why}");
        let sentinel =
            std::env::temp_dir().join(format!("gpuhealth-reboot-required-{}", std::process::id()));
        let (outcome, _) = RebootMethod::Kured(sentinel.clone()).reboot().await;
        assert_eq!(outcome, Outcome::Succeeded);
        assert!(sentinel.exists(), "kured's sentinel was created");
        assert_eq!(
            RebootMethod::Logind(SYSTEM_BUS.into()).published(),
            Method::Logind
        );
    }

    #[tokio::test]
    async fn a_method_that_cannot_work_here_says_why() {
        assert_eq!(RebootMethod::None.check().await, Ok(()));
        let kured = RebootMethod::Kured(std::env::temp_dir().join("reboot-required"));
        assert_eq!(kured.check().await, Ok(()));
        let why = RebootMethod::Kured("/no/such/dir/reboot-required".into())
            .check()
            .await
            .expect_err("no directory");
        assert!(why.contains("/no/such/dir/reboot-required"), "{why}");
        let bus = format!(
            "unix:path={}",
            std::env::temp_dir().join("no-such-bus").display()
        );
        let why = RebootMethod::Logind(bus.clone())
            .check()
            .await
            .expect_err("no bus");
        assert!(why.contains(&bus), "{why}");
    }
}
