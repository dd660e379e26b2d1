//! Running the `kubectl-gpuhealth` binary against the test cluster.

use crate::{cluster::kubeconfig_path, process::built};

/// What one run of `kubectl-gpuhealth ARGS` said.
pub struct Run {
    pub ok: bool,
    pub stdout: String,
    pub stderr: String,
}

pub async fn plugin(args: &[&str]) -> Run {
    let out = tokio::process::Command::new(built("kubectl-gpuhealth"))
        .env("KUBECONFIG", kubeconfig_path().await.expect("kubeconfig"))
        .env("NO_COLOR", "1")
        .args(args)
        .output()
        .await
        .expect("run kubectl-gpuhealth (cargo build -p kubectl-gpuhealth)");
    Run {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}
