//! Who holds a GPU's device node (`/dev/nvidiaN`) open, found as `fuser`
//! does: through every process's open files under `/proc`. With the host's
//! PID namespace this sees every container on the node. The driver refuses
//! to reset a GPU while any of them holds it. A process whose open files
//! cannot be read (a runtime's AppArmor profile, a missing `SYS_PTRACE`)
//! might hold it: it is named, never passed over.

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

/// A process whose open files could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unreadable {
    pub pid: u32,
    pub command: String,
    pub error: String,
}

impl std::fmt::Display for Unreadable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} (pid {}), whose open files cannot be read ({})",
            self.command, self.pid, self.error
        )
    }
}

/// What a look through `/proc` found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scan {
    pub holders: Vec<Holder>,
    pub unreadable: Vec<Unreadable>,
}

/// The same file: a character device by its device number (each container
/// has a node of its own for the same GPU), anything else by inode.
fn same_file(a: &fs::Metadata, b: &fs::Metadata) -> bool {
    if a.file_type().is_char_device() && b.file_type().is_char_device() {
        return a.rdev() == b.rdev();
    }
    a.dev() == b.dev() && a.ino() == b.ino()
}

/// The processes under `proc` holding `device` open, other than this one,
/// and those that might.
pub fn holding(proc: &Path, device: &Path) -> std::io::Result<Scan> {
    let target = fs::metadata(device)?;
    let me = std::process::id();
    let mut found = Vec::new();
    let mut unreadable = Vec::new();
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
        let fds = match fs::read_dir(entry.path().join("fd")) {
            Ok(fds) => fds,
            // It ended while we looked.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                unreadable.push(Unreadable {
                    pid,
                    command: command(proc, pid),
                    error: e.to_string(),
                });
                continue;
            }
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
    unreadable.sort_by_key(|u| u.pid);
    Ok(Scan {
        holders: found,
        unreadable,
    })
}

/// Whether this process may read `pid`'s open files under `proc`, as
/// [`holding`] must read every process's: its `fd` listed, and one entry
/// followed. Listing alone proves nothing: a root process may list
/// another root process's `fd` where following an entry is denied (no
/// `CAP_SYS_PTRACE`, or a runtime's AppArmor profile or SELinux type).
pub fn read_open_files(proc: &Path, pid: u32) -> Result<(), String> {
    let dir = proc.join(pid.to_string()).join("fd");
    let entries = fs::read_dir(&dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    let entry = entries
        .flatten()
        .find(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.parse::<u32>().is_ok())
        })
        .ok_or_else(|| format!("{} lists no open file to follow", dir.display()))?;
    // As `holding` does: the file an entry names.
    fs::metadata(entry.path())
        .map(drop)
        .map_err(|e| format!("cannot follow {}: {e}", entry.path().display()))
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

    /// A process whose `fd` cannot be listed is named; one that ended is not.
    #[test]
    fn a_process_whose_files_cannot_be_read_is_named() {
        let proc = std::env::temp_dir().join(format!("gpuhealth-proc-{}", std::process::id()));
        let _ = fs::remove_dir_all(&proc);
        fs::create_dir_all(proc.join("41")).expect("a process");
        fs::write(proc.join("41/comm"), "dcgm-exporter\n").expect("comm");
        // Not a directory: listing it fails as a denied one does, not as
        // a process that is gone.
        fs::write(proc.join("41/fd"), b"").expect("fd");
        fs::create_dir_all(proc.join("42")).expect("a process that ended");
        let device = proc.join("nvidia0");
        fs::write(&device, b"").expect("device");
        let scan = holding(&proc, &device).expect("scan");
        assert_eq!(scan.holders, []);
        assert_eq!(scan.unreadable.len(), 1, "{scan:?}");
        let named = scan.unreadable[0].to_string();
        assert!(
            named.starts_with("dcgm-exporter (pid 41), whose open files cannot be read ("),
            "{named}"
        );
    }

    /// An entry that cannot be followed fails as a denied one does; so do
    /// an `fd` that cannot be listed and one with nothing in it.
    #[test]
    fn open_files_are_read_only_where_an_entry_can_be_followed() {
        let proc = std::env::temp_dir().join(format!("gpuhealth-fds-{}", std::process::id()));
        let _ = fs::remove_dir_all(&proc);
        fs::create_dir_all(proc.join("7/fd")).expect("a readable process");
        std::os::unix::fs::symlink("/dev/null", proc.join("7/fd/0")).expect("an open file");
        fs::create_dir_all(proc.join("8/fd")).expect("a denied process");
        std::os::unix::fs::symlink(proc.join("gone"), proc.join("8/fd/3")).expect("fd");
        fs::create_dir_all(proc.join("9/fd")).expect("a process with no open file");
        fs::create_dir_all(proc.join("10")).expect("a process");
        fs::write(proc.join("10/fd"), b"").expect("an fd that cannot be listed");
        assert_eq!(read_open_files(&proc, 7), Ok(()));
        let why = read_open_files(&proc, 8).expect_err("not followed");
        assert!(
            why.starts_with("cannot follow ") && why.contains("8/fd/3"),
            "{why}"
        );
        let why = read_open_files(&proc, 9).expect_err("nothing to follow");
        assert!(why.ends_with("9/fd lists no open file to follow"), "{why}");
        let why = read_open_files(&proc, 10).expect_err("not listed");
        assert!(
            why.starts_with("cannot list ") && why.contains("10/fd"),
            "{why}"
        );
        // This process's parent (the test runner, this machine's own).
        assert_eq!(
            read_open_files(Path::new("/proc"), std::os::unix::process::parent_id()),
            Ok(())
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
                let found = holding(Path::new("/proc"), &device).expect("scan").holders;
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
