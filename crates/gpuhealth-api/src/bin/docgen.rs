//! Writes the API reference generated from the CRD schemas (or prints it
//! with `--stdout`). `make docs` runs it; a test fails when the committed
//! file drifts.

use std::{env, fs, process::ExitCode};

fn main() -> ExitCode {
    let text = gpuhealth_api::reference::markdown();
    let target = env::args()
        .nth(1)
        .unwrap_or_else(|| "docs/reference.md".into());
    if target == "--stdout" {
        print!("{text}");
        return ExitCode::SUCCESS;
    }
    match fs::write(&target, text) {
        Ok(()) => {
            println!("wrote {target}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("docgen: cannot write {target}: {e}");
            ExitCode::FAILURE
        }
    }
}
