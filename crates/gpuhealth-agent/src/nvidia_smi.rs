//! How the agent runs `nvidia-smi`: from `PATH` (the NVIDIA runtime puts
//! the driver's in the container), or a driver root's own with that root's
//! loader and libraries ([`crate::driver_root`]), so that it never loads
//! the image's C library beside the driver root's, nor the other way round.

use std::{path::PathBuf, time::Duration};

use crate::driver_root::DriverRoot;

/// How long `nvidia-smi -h` gets to show that it runs at all.
const CHECK_DEADLINE: Duration = Duration::from_secs(10);

#[derive(Clone, Debug)]
pub enum NvidiaSmi {
    /// A program, found on `PATH` when it is a bare name.
    Program(PathBuf),
    /// A driver root's, found in it each time it runs: the driver
    /// container may lay the root out after the agent starts.
    InDriverRoot(DriverRoot),
}

impl NvidiaSmi {
    /// A command that runs it with `args`, or why there is none.
    pub fn command<'a>(
        &self,
        args: impl IntoIterator<Item = &'a str>,
    ) -> Result<tokio::process::Command, String> {
        let mut command = match self {
            NvidiaSmi::Program(program) => tokio::process::Command::new(program),
            NvidiaSmi::InDriverRoot(root) => root.nvidia_smi()?,
        };
        command.args(args).kill_on_drop(true);
        Ok(command)
    }

    /// Whether it runs here (`nvidia-smi -h`, which asks the driver
    /// nothing), or why not.
    pub async fn check(&self) -> Result<(), String> {
        let run = self.command(["-h"])?.output();
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
        match self {
            NvidiaSmi::Program(program) => write!(f, "{}", program.display()),
            NvidiaSmi::InDriverRoot(root) => write!(f, "nvidia-smi of the driver root {root}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_program_that_runs_passes_and_one_that_does_not_says_why() {
        assert_eq!(NvidiaSmi::Program("true".into()).check().await, Ok(()));
        let why = NvidiaSmi::Program("/no/such/nvidia-smi".into())
            .check()
            .await
            .expect_err("not there");
        assert!(why.contains("running /no/such/nvidia-smi"), "{why}");
        let why = NvidiaSmi::Program("false".into())
            .check()
            .await
            .expect_err("fails");
        assert!(why.starts_with("false -h: exit status: 1"), "{why}");
    }
}
