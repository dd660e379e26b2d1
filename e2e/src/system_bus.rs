//! The host's system bus for the agent's reboots: a real `dbus-daemon`,
//! and systemd-logind on it as far as the agent meets it: `Reboot`
//! answered and counted for a caller holding `CAP_SYS_BOOT`, refused to
//! any other, as logind does without polkit; `CanReboot` answered `yes`
//! to such a caller and `challenge` to any other.

use std::{
    path::Path,
    process::Stdio,
    sync::{Arc, Mutex},
};

use futures::StreamExt;
use tokio::process::{Child, Command};

use crate::{HarnessError, Result, wait::Background};

fn io(what: &str) -> impl Fn(std::io::Error) -> HarnessError + '_ {
    move |e| HarnessError::ClusterStart(format!("{what}: {e}"))
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The bus and logind, running.
pub struct SystemBus {
    pub daemon: Child,
    /// logind answering on it.
    pub answering: Background,
}

/// Starts the bus at `socket` (its configuration in `dir`), with logind
/// counting in `reboots` the Reboot calls it accepts.
pub async fn start(socket: &Path, dir: &Path, reboots: Arc<Mutex<u32>>) -> Result<SystemBus> {
    if let Some(parent) = socket.parent() {
        std::fs::create_dir_all(parent).map_err(io("the bus's directory"))?;
    }
    // A bus that answers there is the machine's own: never replace it.
    if std::os::unix::net::UnixStream::connect(socket).is_ok() {
        return Err(HarnessError::ClusterStart(format!(
            "a system bus already answers at {}: the real node's test needs this machine's to itself",
            socket.display()
        )));
    }
    let _ = std::fs::remove_file(socket);
    let config = dir.join("system-bus.conf");
    std::fs::write(
        &config,
        format!(
            r#"<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>system</type>
  <listen>unix:path={}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow own="*"/>
    <allow send_destination="*"/>
    <allow receive_sender="*"/>
  </policy>
</busconfig>
"#,
            socket.display()
        ),
    )
    .map_err(io("the bus's configuration"))?;
    let bus = Command::new("dbus-daemon")
        .arg(format!("--config-file={}", config.display()))
        .args(["--nofork", "--nopidfile"])
        .stdout(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .map_err(io("starting dbus-daemon (Debian's dbus-daemon package)"))?;
    let address = format!("unix:path={}", socket.display());
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(20);
    let connection = loop {
        match zbus::connection::Builder::address(address.as_str())
            .build()
            .await
        {
            Ok(c) => break c,
            Err(e) if tokio::time::Instant::now() > deadline => {
                return Err(HarnessError::ClusterStart(format!("the system bus: {e}")));
            }
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(100)).await,
        }
    };
    connection.request_name("org.freedesktop.login1").await?;
    let answering = Background::spawn(async move {
        let mut calls = zbus::MessageStream::from(&connection);
        while let Some(Ok(call)) = calls.next().await {
            let header = call.header();
            let asked = |member: &str| {
                header.message_type() == zbus::message::Type::MethodCall
                    && header.interface().map(|i| i.as_str())
                        == Some("org.freedesktop.login1.Manager")
                    && header.member().map(|m| m.as_str()) == Some(member)
            };
            if asked("CanReboot") {
                // As logind answers a caller it would refuse without polkit.
                let answer = match caller_may_boot(&connection, &header).await {
                    Ok(()) => "yes",
                    Err(_) => "challenge",
                };
                let _ = connection.reply(&header, &(answer,)).await;
                continue;
            }
            if !asked("Reboot") || call.body().deserialize::<(bool,)>().is_err() {
                continue;
            }
            match caller_may_boot(&connection, &header).await {
                Ok(()) => {
                    *lock(&reboots) += 1;
                    let _ = connection.reply(&header, &()).await;
                }
                Err(why) => {
                    let _ = connection
                        .reply_error(&header, "org.freedesktop.DBus.Error.AccessDenied", &why)
                        .await;
                }
            }
        }
    });
    Ok(SystemBus {
        daemon: bus,
        answering,
    })
}

/// What logind asks of a Reboot caller without polkit: `CAP_SYS_BOOT` in
/// its effective set, read from the process the bus says sent the call.
async fn caller_may_boot(
    bus: &zbus::Connection,
    call: &zbus::message::Header<'_>,
) -> std::result::Result<(), String> {
    let sender = call.sender().ok_or("no sender")?.to_string();
    let reply = bus
        .call_method(
            Some("org.freedesktop.DBus"),
            "/org/freedesktop/DBus",
            Some("org.freedesktop.DBus"),
            "GetConnectionUnixProcessID",
            &(sender.as_str(),),
        )
        .await
        .map_err(|e| format!("the caller's process: {e}"))?;
    let pid: u32 = reply.body().deserialize().map_err(|e| e.to_string())?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("/proc/{pid}/status: {e}"))?;
    let effective = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        .ok_or("no CapEff")?;
    // CAP_SYS_BOOT is capability 22.
    if effective & (1 << 22) == 0 {
        return Err("Interactive authentication required.".into());
    }
    Ok(())
}

impl From<zbus::Error> for HarnessError {
    fn from(e: zbus::Error) -> Self {
        HarnessError::ClusterStart(format!("D-Bus: {e}"))
    }
}
