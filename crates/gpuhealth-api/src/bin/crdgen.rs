//! Writes the CRD YAML into `crds/` (or prints it with `--stdout`).
//! `make crds` runs it; a test fails when the committed YAML drifts.

use std::{env, fs, path::PathBuf, process::ExitCode};

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
    let dir = args
        .first()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("crds"));
    if let Err(e) = fs::create_dir_all(&dir) {
        eprintln!("crdgen: cannot create {}: {e}", dir.display());
        return ExitCode::FAILURE;
    }
    for (file, yaml) in docs {
        let path = dir.join(file);
        if let Err(e) = fs::write(&path, yaml) {
            eprintln!("crdgen: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        println!("wrote {}", path.display());
    }
    ExitCode::SUCCESS
}
