//! Writes the CRD YAML: `--kustomize DIR` (default `crds`) gets the CRDs
//! and a kustomization listing them, `--chart DIR` the CRDs alone (Helm
//! installs every file of a chart's `crds/`); `--stdout` prints them.
//! `make crds` runs it; a test fails when the committed YAML drifts.

use std::{env, fs, path::Path, process::ExitCode};

fn main() -> ExitCode {
    let args: Vec<String> = env::args().skip(1).collect();
    let docs = match gpuhealth_api::crds::rendered() {
        Ok(d) => d,
        Err(e) => {
            eprintln!("crdgen: {e}");
            return ExitCode::FAILURE;
        }
    };
    if args.iter().any(|a| a == "--stdout") {
        for (_, yaml) in &docs {
            print!("---\n{yaml}");
        }
        return ExitCode::SUCCESS;
    }
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .map(String::as_str)
    };
    let kustomization = gpuhealth_api::crds::kustomization();
    let mut writes: Vec<(&Path, &str, &str)> = Vec::new();
    let kustomize = Path::new(flag("--kustomize").unwrap_or("crds"));
    for (file, yaml) in &docs {
        writes.push((kustomize, file, yaml));
    }
    writes.push((kustomize, "kustomization.yaml", &kustomization));
    if let Some(chart) = flag("--chart") {
        for (file, yaml) in &docs {
            writes.push((Path::new(chart), file, yaml));
        }
    }
    for (dir, file, yaml) in writes {
        let path = dir.join(file);
        if let Err(e) = fs::create_dir_all(dir).and_then(|()| fs::write(&path, yaml)) {
            eprintln!("crdgen: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        println!("wrote {}", path.display());
    }
    ExitCode::SUCCESS
}
