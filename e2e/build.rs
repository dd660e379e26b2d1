//! Builds the NVML stand-in (`nvml-standin/`): `libnvidia-ml.so.1` and
//! `nvidia-smi`, from C, with the C compiler on PATH (`CC` if set), and the
//! real-node e2e's GPU workload (`workload/`). The tests find them in
//! `GPUHEALTH_NVML_STANDIN`.

use std::{path::PathBuf, process::Command};

fn main() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("nvml-standin");
    std::fs::create_dir_all(&out).expect("creating the stand-in's directory");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let src = PathBuf::from("nvml-standin");
    let build = |args: &[&str], what: &str| {
        let status = Command::new(&cc)
            .args([
                "-std=c11",
                "-D_GNU_SOURCE",
                "-Wall",
                "-Wextra",
                "-Wno-format-truncation",
                "-O2",
            ])
            .args(args)
            .status()
            .unwrap_or_else(|e| panic!("running the C compiler {cc:?} for {what}: {e}"));
        assert!(status.success(), "building {what} failed: {status}");
    };
    let lib = out.join("libnvidia-ml.so.1");
    let smi = out.join("nvidia-smi");
    build(
        &[
            "-shared",
            "-fPIC",
            "-o",
            lib.to_str().expect("path"),
            "nvml-standin/nvml.c",
            "-lpthread",
        ],
        "the NVML stand-in",
    );
    build(
        &[
            "-o",
            smi.to_str().expect("path"),
            "nvml-standin/nvidia-smi.c",
        ],
        "the nvidia-smi stand-in",
    );
    build(
        &[
            "-o",
            out.join("nvidia-persistenced").to_str().expect("path"),
            "nvml-standin/nvidia-persistenced.c",
        ],
        "the nvidia-persistenced stand-in",
    );
    // The real-node e2e's GPU workload, static: its image holds nothing else.
    let workload = out.join("gpu-workload");
    build(
        &[
            "-static",
            "-o",
            workload.to_str().expect("path"),
            "workload/gpu-workload.c",
        ],
        "the GPU workload",
    );
    println!("cargo:rerun-if-changed=workload/gpu-workload.c");
    for f in ["nvml.c", "nvidia-smi.c", "nvidia-persistenced.c", "state.h"] {
        println!("cargo:rerun-if-changed={}", src.join(f).display());
    }
    println!("cargo:rustc-env=GPUHEALTH_NVML_STANDIN={}", out.display());
}
