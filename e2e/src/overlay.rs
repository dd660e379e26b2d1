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

/// The `replacements:` section of `config/default`: what writes the
/// guardrail ConfigMap's condition types into the admission policy. An
/// overlay that changes the ConfigMap carries it too (kustomize runs a
/// base's replacements before an overlay's patches), as a user's must.
pub fn shipped_replacements() -> Result<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/default/kustomization.yaml");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| HarnessError::Invalid(format!("{}: {e}", path.display())))?;
    let start = text
        .lines()
        .position(|l| l.starts_with("replacements:"))
        .ok_or_else(|| HarnessError::Invalid(format!("{} has no replacements", path.display())))?;
    Ok(text.lines().skip(start).map(|l| format!("{l}\n")).collect())
}
