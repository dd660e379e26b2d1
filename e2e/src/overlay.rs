//! kustomize overlays a test writes over the shipped `config/`, as a user
//! would: under `target/e2e-overlays/<name>`, its bases three levels up.

use std::path::Path;

use crate::{HarnessError, Result};

/// Writes `kustomization` as the overlay `name`; its directory, for `-k`.
pub fn write(name: &str, kustomization: &str) -> Result<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../target/e2e-overlays")
        .join(name);
    let io = |e: std::io::Error| HarnessError::Invalid(format!("the overlay {name}: {e}"));
    std::fs::create_dir_all(&dir).map_err(io)?;
    std::fs::write(dir.join("kustomization.yaml"), kustomization).map_err(io)?;
    Ok(dir.to_string_lossy().into_owned())
}
