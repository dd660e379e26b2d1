//! NVML and `nvidia-smi` from a driver root mounted from the host (the GPU
//! Operator's driver container keeps one at `/run/nvidia/driver`; a driver
//! installed on the host itself is `/`), without mixing two C libraries:
//! the agent loads the root's `libnvidia-ml.so.1` by path (served by the
//! image's glibc, as any library `dlopen` loads), and runs the root's
//! `nvidia-smi` with the root's own loader and libraries. `LD_LIBRARY_PATH`
//! would do neither: the agent, and everything it runs, would load the
//! host's libc beside the image's loader.

use std::path::{Component, PathBuf};

use crate::nvml::NVML_LIBRARY;

/// Where each distribution keeps its libraries, most specific first.
#[cfg(target_arch = "aarch64")]
const LIBRARY_DIRS: &[&str] = &[
    "usr/lib/aarch64-linux-gnu",
    "lib/aarch64-linux-gnu",
    "usr/lib64",
    "lib64",
    "usr/lib",
    "lib",
];
#[cfg(not(target_arch = "aarch64"))]
const LIBRARY_DIRS: &[&str] = &[
    "usr/lib/x86_64-linux-gnu",
    "lib/x86_64-linux-gnu",
    "usr/lib64",
    "lib64",
    "usr/lib",
    "lib",
];
#[cfg(target_arch = "aarch64")]
const LOADER: &str = "ld-linux-aarch64.so.1";
#[cfg(not(target_arch = "aarch64"))]
const LOADER: &str = "ld-linux-x86-64.so.2";

#[derive(Clone, Debug)]
pub struct DriverRoot {
    root: PathBuf,
}

impl DriverRoot {
    pub fn new(root: PathBuf) -> DriverRoot {
        DriverRoot { root }
    }

    /// `path` inside the root, every symbolic link on the way followed
    /// inside it: a driver container's `/lib64/ld-linux-x86-64.so.2` is
    /// often an absolute link, which outside its root names the image's.
    /// `None` where nothing is there.
    pub fn resolve(&self, path: &str) -> Option<PathBuf> {
        let mut pending: Vec<PathBuf> = vec![PathBuf::from(path)];
        let mut at = self.root.clone();
        let mut links = 0;
        while let Some(next) = pending.pop() {
            let mut components: Vec<Component> = next.components().collect();
            components.reverse();
            while let Some(c) = components.pop() {
                match c {
                    Component::RootDir => at = self.root.clone(),
                    Component::CurDir | Component::Prefix(_) => {}
                    Component::ParentDir => {
                        if at != self.root {
                            at.pop();
                        }
                    }
                    Component::Normal(name) => {
                        let candidate = at.join(name);
                        let meta = std::fs::symlink_metadata(&candidate).ok()?;
                        if meta.file_type().is_symlink() {
                            links += 1;
                            if links > 40 {
                                return None;
                            }
                            let target = std::fs::read_link(&candidate).ok()?;
                            let rest: PathBuf = components.iter().rev().collect();
                            pending.push(rest);
                            pending.push(target);
                            break;
                        }
                        at = candidate;
                    }
                }
            }
        }
        at.exists().then_some(at)
    }

    /// The root's library directories that are there, resolved.
    fn library_dirs(&self) -> Vec<PathBuf> {
        let mut dirs: Vec<PathBuf> = Vec::new();
        for d in LIBRARY_DIRS {
            if let Some(p) = self.resolve(d).filter(|p| p.is_dir())
                && !dirs.contains(&p)
            {
                dirs.push(p);
            }
        }
        dirs
    }

    /// The root's `libnvidia-ml.so.1`, to load by path.
    pub fn nvml_library(&self) -> Result<PathBuf, String> {
        self.library_dirs()
            .into_iter()
            .map(|d| d.join(NVML_LIBRARY))
            .find(|p| p.exists())
            .ok_or_else(|| {
                format!(
                    "no {NVML_LIBRARY} in the driver root {} ({})",
                    self.root.display(),
                    LIBRARY_DIRS.join(", ")
                )
            })
    }

    /// A command running the root's `nvidia-smi` by the root's loader, with
    /// the root's libraries searched first and no `ld.so.cache` read.
    pub fn nvidia_smi(&self) -> Result<tokio::process::Command, String> {
        let program = ["usr/bin/nvidia-smi", "bin/nvidia-smi"]
            .iter()
            .find_map(|p| self.resolve(p))
            .ok_or_else(|| format!("no nvidia-smi in the driver root {}", self.root.display()))?;
        let loader = ["lib64", "usr/lib64"]
            .iter()
            .chain(LIBRARY_DIRS)
            .find_map(|d| self.resolve(&format!("{d}/{LOADER}")))
            .ok_or_else(|| format!("no {LOADER} in the driver root {}", self.root.display()))?;
        let library_path: Vec<String> = self
            .library_dirs()
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        let mut command = tokio::process::Command::new(loader);
        command
            .args(["--inhibit-cache", "--library-path", &library_path.join(":")])
            .arg(program);
        Ok(command)
    }
}

impl std::fmt::Display for DriverRoot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.root.display())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::{os::unix::fs::symlink, path::Path};

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("gpuhealth-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("scratch dir");
        dir
    }

    /// A driver root laid out as Ubuntu's: libraries under
    /// `usr/lib/x86_64-linux-gnu`, `lib` a relative link to `usr/lib`, and
    /// `lib64/ld-linux-x86-64.so.2` an absolute link.
    fn ubuntu_like(root: &Path) {
        let libs = root
            .join("usr/lib")
            .join(LIBRARY_DIRS[0].trim_start_matches("usr/lib/"));
        std::fs::create_dir_all(&libs).expect("libs");
        std::fs::create_dir_all(root.join("usr/bin")).expect("bin");
        std::fs::create_dir_all(root.join("lib64")).expect("lib64");
        symlink("usr/lib", root.join("lib")).expect("lib link");
        std::fs::write(libs.join(LOADER), b"").expect("loader");
        std::fs::write(libs.join(NVML_LIBRARY), b"").expect("nvml");
        std::fs::write(root.join("usr/bin/nvidia-smi"), b"").expect("nvidia-smi");
        symlink(
            format!("/{}/{LOADER}", LIBRARY_DIRS[1]),
            root.join("lib64").join(LOADER),
        )
        .expect("loader link");
    }

    #[test]
    fn links_are_followed_inside_the_root_never_out_of_it() {
        let root = scratch("driver-root");
        ubuntu_like(&root);
        let libs = root.join(LIBRARY_DIRS[0]);
        // The absolute link lands in the root's library directory, not the
        // image's.
        assert_eq!(
            DriverRoot::new(root.clone()).resolve(&format!("lib64/{LOADER}")),
            Some(libs.join(LOADER))
        );
        symlink("../../../../../etc/passwd", root.join("escape")).expect("link");
        assert_eq!(DriverRoot::new(root.clone()).resolve("escape"), None);
        let driver = DriverRoot::new(root.clone());
        assert_eq!(driver.nvml_library(), Ok(libs.join(NVML_LIBRARY)));
        let smi = driver.nvidia_smi().expect("nvidia-smi");
        let smi = smi.as_std();
        assert_eq!(smi.get_program(), libs.join(LOADER));
        let args: Vec<_> = smi.get_args().collect();
        assert_eq!(
            args.last().copied(),
            Some(root.join("usr/bin/nvidia-smi").as_os_str())
        );
        // The root's own libraries first.
        let library_path = args[2].to_string_lossy();
        assert!(
            library_path.starts_with(&format!("{}:", libs.display())),
            "{args:?}"
        );
        let empty = scratch("driver-root-empty");
        let why = DriverRoot::new(empty.clone())
            .nvml_library()
            .expect_err("nothing there");
        assert!(why.contains(&empty.display().to_string()), "{why}");
    }

    /// A root the driver container has not laid out yet has no nvidia-smi
    /// to run; once laid out, its own runs, by its own loader.
    #[tokio::test]
    async fn the_roots_nvidia_smi_runs_with_the_roots_own_loader() {
        let root = scratch("driver-root-run");
        let driver = DriverRoot::new(root.clone());
        let why = driver.nvidia_smi().expect_err("nothing there yet");
        assert_eq!(
            why,
            format!("no nvidia-smi in the driver root {}", root.display())
        );
        lay_out_runnable(&root);
        let out = driver
            .nvidia_smi()
            .expect("nvidia-smi")
            .arg("-h")
            .output()
            .await
            .expect("run");
        assert!(out.status.success(), "{out:?}");
    }

    fn lay_out_runnable(root: &Path) {
        let libs = root.join(LIBRARY_DIRS[0]);
        std::fs::create_dir_all(&libs).expect("libs");
        std::fs::create_dir_all(root.join("usr/bin")).expect("bin");
        let host_libs = Path::new("/").join(LIBRARY_DIRS[1]);
        for lib in [LOADER, "libc.so.6"] {
            std::fs::copy(host_libs.join(lib), libs.join(lib))
                .unwrap_or_else(|e| panic!("copying this machine's {lib}: {e}"));
        }
        std::fs::copy("/bin/true", root.join("usr/bin/nvidia-smi")).expect("true");
    }
}
