//! Who holds a GPU's device node (`/dev/nvidiaN`) open, found as `fuser`
//! does: through every process's open files under `/proc`. With the host's
//! PID namespace this sees every container on the node. The driver refuses
//! to reset a GPU while any of them holds it.

use std::{
    fs,
    os::unix::fs::{FileTypeExt, MetadataExt},
    path::Path,
};

/// A process holding a GPU.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Holder {
    pub pid: u32,
    /// Its command name (`/proc/PID/comm`).
    pub command: String,
    /// The UID of the pod it runs in, from its cgroup, when it runs in one.
    pub pod_uid: Option<String>,
}

impl std::fmt::Display for Holder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (pid {}", self.command, self.pid)?;
        if let Some(uid) = &self.pod_uid {
            write!(f, ", pod {uid}")?;
        }
        write!(f, ")")
    }
}

/// The same file: a character device by its device number (each container
/// has a node of its own for the same GPU), anything else by inode.
fn same_file(a: &fs::Metadata, b: &fs::Metadata) -> bool {
    if a.file_type().is_char_device() && b.file_type().is_char_device() {
        return a.rdev() == b.rdev();
    }
    a.dev() == b.dev() && a.ino() == b.ino()
}

/// The processes under `proc` holding `device` open, other than this one.
pub fn holding(proc: &Path, device: &Path) -> std::io::Result<Vec<Holder>> {
    let target = fs::metadata(device)?;
    let me = std::process::id();
    let mut found = Vec::new();
    for entry in fs::read_dir(proc)?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == me {
            continue;
        }
        // A process may end, or hide its files, while we look: skip it.
        let Ok(fds) = fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        let holds = fds
            .flatten()
            .any(|fd| fs::metadata(fd.path()).is_ok_and(|m| same_file(&m, &target)));
        if holds {
            found.push(Holder {
                pid,
                command: command(proc, pid),
                pod_uid: fs::read_to_string(entry.path().join("cgroup"))
                    .ok()
                    .and_then(|c| pod_uid(&c)),
            });
        }
    }
    found.sort_by_key(|h| h.pid);
    Ok(found)
}

/// A process's command name (`/proc/PID/comm`), `?` if it is gone.
pub fn command(proc: &Path, pid: u32) -> String {
    fs::read_to_string(proc.join(pid.to_string()).join("comm"))
        .map(|c| c.trim().to_owned())
        .unwrap_or_else(|_| "?".into())
}

/// The pod UID in a process's cgroup path: `…/kubepods/burstable/pod<UID>/…`
/// (cgroupfs) or `…/kubepods-burstable-pod<UID_with_underscores>.slice/…`
/// (systemd).
pub fn pod_uid(cgroup: &str) -> Option<String> {
    cgroup
        .lines()
        .filter(|line| line.contains("kubepods"))
        .find_map(|line| {
            line.match_indices("pod").find_map(|(at, _)| {
                let uid: String = line[at + 3..]
                    .chars()
                    .take_while(|c| c.is_ascii_hexdigit() || *c == '-' || *c == '_')
                    .collect();
                (uid.len() == 36).then(|| uid.replace('_', "-"))
            })
        })
}

/// The kernel keeps a command name to 15 bytes.
const COMM_LEN: usize = 15;

/// Those holders the driver does not count against a reset: commands in
/// `tolerated` (matched as `/proc/PID/comm` shows them, cut to 15 bytes).
pub fn counted(holders: Vec<Holder>, tolerated: &[String]) -> Vec<Holder> {
    let is_tolerated = |h: &Holder| {
        tolerated
            .iter()
            .any(|t| *t == h.command || (h.command.len() == COMM_LEN && t.starts_with(&h.command)))
    };
    holders.into_iter().filter(|h| !is_tolerated(h)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_is_named_by_its_cgroup_in_either_driver() {
        let cgroupfs = "0::/kubepods/burstable/pod0c5e1a2b-3c4d-4e5f-8a9b-0c1d2e3f4a5b/4f2e9c";
        assert_eq!(
            pod_uid(cgroupfs).as_deref(),
            Some("0c5e1a2b-3c4d-4e5f-8a9b-0c1d2e3f4a5b")
        );
        let systemd = "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0c5e1a2b_3c4d_4e5f_8a9b_0c1d2e3f4a5b.slice/cri-containerd-4f2e.scope";
        assert_eq!(
            pod_uid(systemd).as_deref(),
            Some("0c5e1a2b-3c4d-4e5f-8a9b-0c1d2e3f4a5b")
        );
        assert_eq!(
            pod_uid("0::/system.slice/nvidia-persistenced.service"),
            None
        );
    }

    #[test]
    fn a_process_holding_the_file_is_found_and_this_one_is_not() {
        let dir = std::env::temp_dir().join(format!("gpuhealth-holders-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("dir");
        let device = dir.join("nvidia7");
        fs::write(&device, b"").expect("device");
        // This process holds it too, and is left out. (A process another
        // test forks holds it for an instant before its exec closes it.)
        let _mine = fs::File::open(&device).expect("open");
        let until = |want: &dyn Fn(&[Holder]) -> bool| {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            loop {
                let found = holding(Path::new("/proc"), &device).expect("scan");
                if want(&found) || std::time::Instant::now() > deadline {
                    break found;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        };
        assert_eq!(until(&|f| f.is_empty()), []);
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("exec 3<'{}'; exec sleep 30", device.display()))
            .spawn()
            .expect("sh");
        let pid = child.id();
        let found = until(&|f| f.iter().any(|h| h.pid == pid && h.command == "sleep"));
        let found: Vec<Holder> = found.into_iter().filter(|h| h.pid == pid).collect();
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].pid, pid);
        assert_eq!(found[0].command, "sleep");
        assert_eq!(found[0].to_string(), format!("sleep (pid {pid})"));
        assert_eq!(counted(found.clone(), &["sleep".into()]), []);
        assert_eq!(
            counted(found.clone(), &["nvidia-persistenced".into()]),
            found
        );
    }
}
