//! How the agent reboots its node.
//!
//! The shipped way asks systemd-logind over the host's system D-Bus socket
//! (`/run/dbus/system_bus_socket`, mounted from the host): the call
//! `systemctl reboot` makes, with no binary in the image and no host PID
//! namespace, and a clean shutdown that honours logind's inhibitors (the
//! kubelet's graceful node shutdown among them). logind lets a caller with
//! `CAP_SYS_BOOT` reboot without asking polkit.

use std::{path::PathBuf, time::Duration};

use gpuhealth_api::contract::{Outcome, RebootMethod as Method};

use crate::backend::Done;

/// How long the bus gets to answer.
const BUS_DEADLINE: Duration = Duration::from_secs(30);

#[derive(Clone, Debug)]
pub enum RebootMethod {
    /// Refuse: a person or another tool reboots.
    None,
    /// Create kured's sentinel file; kured reboots under its own lock.
    Kured(PathBuf),
    /// `org.freedesktop.login1.Manager.Reboot` on the system bus
    /// (`DBUS_SYSTEM_BUS_ADDRESS`, else the standard socket).
    Logind,
}

impl RebootMethod {
    /// What the report says of it.
    pub fn published(&self) -> Method {
        match self {
            RebootMethod::None => Method::None,
            RebootMethod::Kured(_) => Method::Kured,
            RebootMethod::Logind => Method::Logind,
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
            RebootMethod::Logind => match tokio::time::timeout(BUS_DEADLINE, logind_reboot()).await
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

async fn logind_reboot() -> zbus::Result<()> {
    let bus = zbus::Connection::system().await?;
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
        assert_eq!(RebootMethod::Logind.published(), Method::Logind);
    }
}
