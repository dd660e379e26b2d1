//! What the Dockerfiles say, checked without a container engine: each
//! copies every workspace member cargo needs (from `cargo metadata`, so a new
//! member cannot be forgotten), builds a binary of the workspace and runs it,
//! and the manifests in config/ name an image for each binary that runs in
//! the cluster. `make images` builds the images themselves from the same
//! files (images/pack.py), and the real-node e2e runs them.

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

/// The workspace members' directories, relative to the root, as cargo
/// itself lists them.
fn workspace_members() -> Vec<PathBuf> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args([
            "metadata",
            "--no-deps",
            "--format-version",
            "1",
            "--manifest-path",
        ])
        .arg(root().join("Cargo.toml"))
        .output()
        .expect("running cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).expect("its JSON");
    let workspace = PathBuf::from(metadata["workspace_root"].as_str().expect("workspace_root"));
    let members: Vec<&str> = metadata["workspace_members"]
        .as_array()
        .expect("workspace_members")
        .iter()
        .filter_map(|m| m.as_str())
        .collect();
    let dirs: Vec<PathBuf> = metadata["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .filter(|p| p["id"].as_str().is_some_and(|id| members.contains(&id)))
        .map(|p| {
            let manifest = Path::new(p["manifest_path"].as_str().expect("manifest_path"));
            manifest
                .parent()
                .expect("a manifest's directory")
                .strip_prefix(&workspace)
                .expect("a member under the workspace")
                .to_owned()
        })
        .collect();
    assert_eq!(dirs.len(), members.len(), "a directory for each member");
    dirs
}

/// The paths the build context leaves out (`.dockerignore`).
fn ignored() -> Vec<String> {
    std::fs::read_to_string(root().join(".dockerignore"))
        .expect(".dockerignore")
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(String::from)
        .collect()
}

#[test]
fn each_dockerfile_copies_every_workspace_member_and_builds_a_binary_of_the_workspace() {
    let dockerfiles: Vec<PathBuf> = std::fs::read_dir(root().join("images"))
        .expect("images/")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "Dockerfile"))
        .collect();
    assert_eq!(dockerfiles.len(), 3, "one per binary: {dockerfiles:?}");
    let workspace = std::fs::read_to_string(root().join("Cargo.toml")).expect("Cargo.toml");
    let members = workspace_members();
    assert!(
        members.iter().any(|m| m == Path::new("bench")),
        "{members:?}"
    );
    let ignored = ignored();
    for path in &dockerfiles {
        let text = std::fs::read_to_string(path).expect("Dockerfile");
        let name = path.display();
        assert!(text.contains("AS build"), "{name}: multi-stage");
        let mut built = None;
        let mut copied_out = None;
        let mut copied: Vec<PathBuf> = Vec::new();
        for line in text.lines().map(str::trim) {
            let words: Vec<&str> = line.split_whitespace().collect();
            match words.as_slice() {
                ["COPY", from, .., dest] if from.starts_with("--from=") => {
                    copied_out = Some(dest.trim_start_matches('/').to_owned());
                }
                ["COPY", sources @ .., _dest] => {
                    for s in sources {
                        assert!(root().join(s).exists(), "{name}: COPY {s}: no such path");
                        copied.push(PathBuf::from(s));
                    }
                }
                ["RUN", "cargo", "build", rest @ ..] => {
                    let p = rest.iter().position(|w| *w == "-p").expect("-p PACKAGE");
                    built = Some(rest[p + 1].to_owned());
                }
                _ => {}
            }
        }
        for file in ["Cargo.toml", "Cargo.lock"] {
            assert!(
                copied.iter().any(|c| c == Path::new(file)),
                "{name}: copies no {file}"
            );
        }
        for member in &members {
            assert!(
                copied.iter().any(|c| member.starts_with(c)),
                "{name}: copies nothing of the workspace member {}: cargo fails without its manifest",
                member.display()
            );
            assert!(
                !ignored.iter().any(|i| member.starts_with(i)),
                ".dockerignore leaves out the workspace member {}",
                member.display()
            );
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
        ("config/agent/base/executor.yaml", "gpuhealth-agent"),
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
