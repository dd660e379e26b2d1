//! A file of the agent's state directory: JSON, read whole, replaced whole.

use std::{
    fs,
    io::{self, Write},
    path::{Path, PathBuf},
};

use serde::{Serialize, de::DeserializeOwned};

/// A state file that could not be read or written.
#[derive(Debug, thiserror::Error)]
#[error("{}: {source}", path.display())]
pub struct StateFileError {
    pub path: PathBuf,
    pub source: io::Error,
}

impl From<StateFileError> for String {
    fn from(e: StateFileError) -> String {
        e.to_string()
    }
}

fn at(path: &Path) -> impl Fn(io::Error) -> StateFileError + '_ {
    move |source| StateFileError {
        path: path.to_path_buf(),
        source,
    }
}

/// The file at `path`; `None` when there is none. One that cannot be
/// parsed is an error, never `None`.
pub fn read<T: DeserializeOwned>(path: &Path) -> Result<Option<T>, StateFileError> {
    match fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| at(path)(io::Error::new(io::ErrorKind::InvalidData, e))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(at(path)(e)),
    }
}

/// Writes `value` whole to a temporary file and renames it over `path`, so
/// a reader sees the old or the new, never half; `sync` where it must
/// outlive a crash of the node.
pub fn replace<T: Serialize>(path: &Path, value: &T, sync: bool) -> Result<(), StateFileError> {
    let err = at(path);
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).map_err(&err)?;
    }
    let tmp = path.with_extension("json.tmp");
    let bytes = serde_json::to_vec_pretty(value).map_err(|e| err(io::Error::other(e)))?;
    let mut file = fs::File::create(&tmp).map_err(&err)?;
    file.write_all(&bytes).map_err(&err)?;
    if sync {
        file.sync_all().map_err(&err)?;
    }
    fs::rename(&tmp, path).map_err(err)
}
