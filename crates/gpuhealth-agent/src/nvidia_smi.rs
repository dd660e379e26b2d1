//! How the agent runs `nvidia-smi`: from `PATH` (the NVIDIA runtime puts
//! the driver's in the container), or a driver root's own with that root's
//! loader and libraries ([`crate::driver_root`]), so that it never loads
//! the image's C library beside the driver root's, nor the other way round.

use std::{path::PathBuf, time::Duration};

/// How long `nvidia-smi -h` gets to show that it runs at all.
const CHECK_DEADLINE: Duration = Duration::from_secs(10);

#[derive(Clone, Debug)]
pub struct NvidiaSmi {
    program: PathBuf,
    /// A driver root's dynamic loader and its library directories.
    loader: Option<(PathBuf, String)>,
}

impl NvidiaSmi {
    /// `program`, found on `PATH` when it is a bare name.
    pub fn program(program: PathBuf) -> NvidiaSmi {
        NvidiaSmi {
            program,
            loader: None,
        }
    }

    /// `program` run by `loader` with `library_path` (`:`-separated)
    /// searched before anything else, and no `ld.so.cache` read.
    pub fn with_loader(program: PathBuf, loader: PathBuf, library_path: String) -> NvidiaSmi {
        NvidiaSmi {
            program,
            loader: Some((loader, library_path)),
        }
    }

    /// A command that runs it with `args`.
    pub fn command<'a>(&self, args: impl IntoIterator<Item = &'a str>) -> tokio::process::Command {
        let mut command = match &self.loader {
            None => tokio::process::Command::new(&self.program),
            Some((loader, library_path)) => {
                let mut c = tokio::process::Command::new(loader);
                c.args(["--inhibit-cache", "--library-path", library_path])
                    .arg(&self.program);
                c
            }
        };
        command.args(args).kill_on_drop(true);
        command
    }

    /// Whether it runs here (`nvidia-smi -h`, which asks the driver
    /// nothing), or why not.
    pub async fn check(&self) -> Result<(), String> {
        let run = self.command(["-h"]).output();
        match tokio::time::timeout(CHECK_DEADLINE, run).await {
            Ok(Ok(out)) if out.status.success() => Ok(()),
            Ok(Ok(out)) => Err(format!(
                "{self} -h: {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )),
            Ok(Err(e)) => Err(format!("running {self}: {e}")),
            Err(_) => Err(format!(
                "{self} -h did not finish within {CHECK_DEADLINE:?}"
            )),
        }
    }
}

impl std::fmt::Display for NvidiaSmi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.loader {
            None => write!(f, "{}", self.program.display()),
            Some((loader, _)) => write!(f, "{} (by {})", self.program.display(), loader.display()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_program_that_runs_passes_and_one_that_does_not_says_why() {
        assert_eq!(NvidiaSmi::program("true".into()).check().await, Ok(()));
        let why = NvidiaSmi::program("/no/such/nvidia-smi".into())
            .check()
            .await
            .expect_err("not there");
        assert!(why.contains("running /no/such/nvidia-smi"), "{why}");
        let why = NvidiaSmi::program("false".into())
            .check()
            .await
            .expect_err("fails");
        assert!(why.starts_with("false -h: exit status: 1"), "{why}");
    }
}
