//! A file of the agent's state directory: JSON, read whole, replaced whole.

use std::{fs, io::Write, path::Path};

use serde::{Serialize, de::DeserializeOwned};

/// A JSON file of the state directory; `None` when there is none.
pub fn read<T: DeserializeOwned>(path: &Path) -> Result<Option<T>, String> {
    match fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// Writes `value` whole to a temporary file and renames it over `path`, so
/// a reader sees the old or the new, never half; `sync` where it must
/// outlive a crash of the node.
pub fn replace<T: Serialize>(path: &Path, value: &T, sync: bool) -> Result<(), String> {
    let err = |e: std::io::Error| format!("{}: {e}", path.display());
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(err)?;
    }
    let tmp = path.with_extension("json.tmp");
    let bytes = serde_json::to_vec_pretty(value).map_err(|e| e.to_string())?;
    let mut file = fs::File::create(&tmp).map_err(err)?;
    file.write_all(&bytes).map_err(err)?;
    if sync {
        file.sync_all().map_err(err)?;
    }
    fs::rename(&tmp, path).map_err(err)
}
