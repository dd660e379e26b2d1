//! The container images cannot be built on this machine (no container
//! engine); this checks what can be checked without one: every path a
//! Dockerfile copies from the repository exists, every package it builds
//! is in the workspace with the binary it copies out, and the manifests
//! in config/ name an image for each binary that runs in the cluster.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The binaries a package builds: `src/main.rs` under the package's name,
/// and each `src/bin/*.rs`.
fn binaries(package: &str) -> Vec<String> {
    let dir = ["crates", "."]
        .iter()
        .map(|d| root().join(d).join(package))
        .find(|d| d.join("Cargo.toml").exists())
        .unwrap_or_else(|| panic!("package {package} is not a directory of the workspace"));
    let mut bins = Vec::new();
    if dir.join("src/main.rs").exists() {
        bins.push(package.to_owned());
    }
    if let Ok(entries) = std::fs::read_dir(dir.join("src/bin")) {
        for e in entries.flatten() {
            if let Some(stem) = e.path().file_stem().and_then(|s| s.to_str()) {
                bins.push(stem.to_owned());
            }
        }
    }
    bins
}

#[test]
fn each_dockerfile_copies_what_exists_and_builds_a_binary_of_the_workspace() {
    let dockerfiles: Vec<PathBuf> = std::fs::read_dir(root().join("images"))
        .expect("images/")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "Dockerfile"))
        .collect();
    assert_eq!(dockerfiles.len(), 3, "one per binary: {dockerfiles:?}");
    let workspace = std::fs::read_to_string(root().join("Cargo.toml")).expect("Cargo.toml");
    for path in &dockerfiles {
        let text = std::fs::read_to_string(path).expect("Dockerfile");
        let name = path.display();
        assert!(text.contains("AS build"), "{name}: multi-stage");
        let mut built = None;
        let mut copied_out = None;
        for line in text.lines().map(str::trim) {
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["COPY", from, .., dest] if from.starts_with("--from=") => {
                    copied_out = Some(dest.trim_start_matches('/').to_owned());
                }
                ["COPY", sources @ .., _dest] => {
                    for s in sources {
                        assert!(root().join(s).exists(), "{name}: COPY {s}: no such path");
                    }
                }
                ["RUN", "cargo", "build", rest @ ..] => {
                    let p = rest.iter().position(|w| *w == "-p").expect("-p PACKAGE");
                    built = Some(rest[p + 1].to_owned());
                }
                _ => {}
            }
        }
        let package = built.unwrap_or_else(|| panic!("{name}: builds no package"));
        assert!(
            workspace.contains(&format!("\"crates/{package}\"")),
            "{name}: {package} is not a workspace member"
        );
        let binary = copied_out.unwrap_or_else(|| panic!("{name}: copies no binary out"));
        assert!(
            binaries(&package).contains(&binary),
            "{name}: {package} builds no binary {binary}"
        );
        assert!(
            text.contains(&format!("release/{binary} ")),
            "{name}: copies {binary} from the release build"
        );
        assert!(
            text.contains(&format!("ENTRYPOINT [\"/{binary}\"]")),
            "{name}: runs {binary}"
        );
    }
}

#[test]
fn the_manifests_run_the_images_the_dockerfiles_build() {
    for (manifest, binary) in [
        ("config/operator/deployment.yaml", "gpuhealth-operator"),
        ("config/agent/base/daemonset.yaml", "gpuhealth-agent"),
    ] {
        let text = std::fs::read_to_string(root().join(manifest)).expect(manifest);
        assert!(
            text.contains(&format!("image: ghcr.io/gpuhealth/{binary}:")),
            "{manifest} runs {binary}"
        );
        assert!(
            root()
                .join(format!(
                    "images/{}.Dockerfile",
                    binary.trim_start_matches("gpuhealth-")
                ))
                .exists(),
            "a Dockerfile builds {binary}"
        );
    }
}
