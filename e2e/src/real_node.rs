//! The real node (`e2e/node/node.sh`): a kubelet and containerd on this
//! machine, joined to the test cluster, with the NVML stand-in's GPUs on a
//! [`Host`] at their real paths. What runs there runs as real pods: the
//! images `make images` built, imported into the node's containerd, and
//! the test's own (the GPU workload, the device plugin stand-in), packed
//! here with `images/pack.py`.

use std::path::{Path, PathBuf};

use k8s_openapi::api::core::v1::Pod;
use tokio::process::Command;

use crate::{
    HarnessError, Result,
    cluster::kubeconfig_path,
    host::{Host, STANDIN},
    process::ProcStatus,
};

/// The Node the real kubelet registers.
pub const NAME: &str = "gpuhealth-real-0";

/// Where `node.sh` lays out a driver container's root: the NVML stand-in,
/// its nvidia-smi and nvidia-persistenced, and the C library they need.
pub const DRIVER_ROOT: &str = "/run/nvidia/driver";

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn failed(what: &str) -> impl Fn(std::io::Error) -> HarnessError + '_ {
    move |e| HarnessError::ClusterStart(format!("{what}: {e}"))
}

async fn run(what: &str, command: &mut Command) -> Result<String> {
    let out = command.output().await.map_err(failed(what))?;
    if !out.status.success() {
        return Err(HarnessError::ClusterStart(format!(
            "{what}: {}: {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The real node, up.
pub struct RealNode {
    pub name: String,
    /// Its GPUs, its nvidia-persistenced and its system bus.
    pub host: Host,
    state: PathBuf,
}

impl RealNode {
    /// The node's host first (its GPUs, nvidia-persistenced holding them,
    /// the system bus with logind, as a GPU node has them before its
    /// kubelet starts), then the node itself. The cluster must have been
    /// started for a real node (`make e2e-node` does).
    pub async fn up() -> Result<RealNode> {
        let kubeconfig = kubeconfig_path().await?;
        let state = kubeconfig
            .parent()
            .ok_or_else(|| HarnessError::Invalid("a kubeconfig without a directory".into()))?
            .to_owned();
        if !state.join("node-address").exists() {
            return Err(HarnessError::Invalid(format!(
                "the cluster in {} was not started for a real node: run `make e2e-node`",
                state.display()
            )));
        }
        let mut host = Host::real(NAME, 8)?;
        host.persistenced().await?;
        host.system_bus().await?;
        run(
            "e2e/node/node.sh up",
            Command::new(repo_root().join("e2e/node/node.sh"))
                .arg("up")
                .env("GPUHEALTH_CLUSTER_DIR", &state)
                .env("GPUHEALTH_STANDIN_ROOT", host.nvml())
                .env("GPUHEALTH_NVML_STANDIN", STANDIN),
        )
        .await?;
        Ok(RealNode {
            name: NAME.to_owned(),
            host,
            state,
        })
    }

    /// Imports OCI image archives into the node's containerd, each also
    /// under its name with its digest.
    pub async fn import(&self, archives: &[PathBuf]) -> Result<()> {
        run(
            "e2e/node/node.sh import",
            Command::new(repo_root().join("e2e/node/node.sh"))
                .arg("import")
                .args(archives)
                .env("GPUHEALTH_CLUSTER_DIR", &self.state),
        )
        .await
        .map(drop)
    }

    /// The test's own images (the GPU workload, the device plugin
    /// stand-in), packed from their Dockerfiles in `e2e/images/` and
    /// imported: their names, with digests.
    pub async fn test_images(&self) -> Result<TestImages> {
        let root = repo_root();
        let out = root.join("target/real-node-images");
        let bins = root.join("target/real-node-bins");
        std::fs::create_dir_all(&bins).map_err(failed("target/real-node-bins"))?;
        // The workload, as e2e/build.rs built it; the plugin, as
        // e2e/node/build.sh did (node.sh up ran it).
        std::fs::copy(format!("{STANDIN}/gpu-workload"), bins.join("gpu-workload"))
            .map_err(failed("the GPU workload"))?;
        std::fs::copy(
            root.join("target/node-standins/gpuhealth-device-plugin"),
            bins.join("gpuhealth-device-plugin"),
        )
        .map_err(failed("the device plugin stand-in"))?;
        run(
            "images/pack.py",
            Command::new("python3")
                .arg(root.join("images/pack.py"))
                .arg("--bin-dir")
                .arg(&bins)
                .arg("--out")
                .arg(&out)
                .args(["--repository", "gpuhealth.local/e2e"])
                .arg(root.join("e2e/images/gpu-workload.Dockerfile"))
                .arg(root.join("e2e/images/device-plugin.Dockerfile")),
        )
        .await?;
        let archives = ["gpu-workload", "gpuhealth-device-plugin"]
            .map(|name| out.join(format!("{name}.oci.tar")));
        self.import(&archives).await?;
        let reference = |name: &str| -> Result<String> {
            std::fs::read_to_string(out.join(format!("{name}.ref")))
                .map(|r| r.trim().to_owned())
                .map_err(failed("an image's reference"))
        };
        Ok(TestImages {
            workload: reference("gpu-workload")?,
            device_plugin: reference("gpuhealth-device-plugin")?,
        })
    }
}

/// The test's images, by name and digest.
pub struct TestImages {
    pub workload: String,
    pub device_plugin: String,
}

/// The images `make images` built (`target/images/`): each archive, and the
/// name with digest a manifest runs it by.
pub fn shipped_images() -> Result<Vec<(PathBuf, String)>> {
    let dir = repo_root().join("target/images");
    ["gpuhealth-operator", "gpuhealth-agent"]
        .iter()
        .map(|name| {
            let archive = dir.join(format!("{name}.oci.tar"));
            let reference =
                std::fs::read_to_string(dir.join(format!("{name}.ref"))).map_err(|e| {
                    HarnessError::Invalid(format!(
                        "{}: {e}: run `make images` first",
                        archive.display()
                    ))
                })?;
            Ok((archive, reference.trim().to_owned()))
        })
        .collect()
}

/// The host process of `pod`'s first container: the one whose cgroup
/// names the container's id.
pub fn container_process(pod: &Pod) -> u32 {
    let id = pod
        .status
        .as_ref()
        .and_then(|s| s.container_statuses.as_ref())
        .and_then(|c| c.first())
        .and_then(|c| c.container_id.clone())
        .expect("a container id");
    let id = id.rsplit("://").next().unwrap_or_default().to_owned();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
        let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
        if cgroup.contains(&id) && exe.ends_with("gpuhealth-agent") {
            found.push(pid);
        }
    }
    assert_eq!(
        found.len(),
        1,
        "the agent's process of container {id}: {found:?}"
    );
    found[0]
}

/// What a part's process holds on the host, read from the kernel: its
/// effective capabilities, whether it may gain more, whether it shares the
/// host's PID namespace (so the host's processes, `/proc/1/root` among
/// them), and whether the host's system bus is mounted in it.
#[derive(Debug, PartialEq)]
pub struct Confinement {
    pub effective: u64,
    pub no_new_privileges: bool,
    pub host_pids: bool,
    pub system_bus: bool,
}

pub fn confinement(pid: u32) -> Confinement {
    let status = ProcStatus::of(pid).expect("status");
    let held = status.capabilities().expect("capabilities");
    let mounts = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).expect("mountinfo");
    Confinement {
        effective: held.effective,
        no_new_privileges: held.no_new_privileges,
        // Its PID in each namespace it is nested in, outermost first: one
        // only where it is in this (the host's) namespace.
        host_pids: status.field("NSpid:").split_whitespace().count() == 1,
        system_bus: mounts
            .lines()
            .any(|l| l.split_whitespace().nth(4) == Some("/run/dbus")),
    }
}
