//! The peer controller: Medik8s Node Healthcheck, reacting to the same node
//! condition as gpuhealth. Running it needs its source from the Go module
//! proxy; each run asks the proxy again and reports its answer, so the
//! summary says exactly why the comparison is missing, not from memory.

use std::process::Command;

use crate::report::Peer;

pub const MODULE: &str = "github.com/medik8s/node-healthcheck-operator";

/// Asks the Go module proxy for the peer's latest release.
pub fn probe() -> Peer {
    let asked = format!("go mod download -json {MODULE}@latest");
    let output = Command::new("timeout")
        .args(["120", "go", "mod", "download", "-json"])
        .arg(format!("{MODULE}@latest"))
        // Outside any module, so that no go.mod is read or changed.
        .current_dir(std::env::temp_dir())
        .output();
    let why_not = match output {
        Err(e) => format!("`{asked}` could not run: {e}"),
        Ok(out) => match answer(&String::from_utf8_lossy(&out.stdout)) {
            Answer::Refused(error) => {
                format!("Its source cannot be had here: `{asked}` answered: {error}")
            }
            Answer::Served(version) => format!(
                "The Go module proxy serves {MODULE} {version}, but building it and giving it a \
                 remediation template to create is not implemented in the benchmark yet."
            ),
            Answer::Unreadable => format!(
                "`{asked}` exited with {} and printed nothing readable: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        },
    };
    Peer {
        ran: false,
        why_not,
    }
}

#[derive(Debug, PartialEq)]
enum Answer {
    Served(String),
    Refused(String),
    Unreadable,
}

/// Reads `go mod download -json`'s one object: an `Error`, or the `Version`.
fn answer(json: &str) -> Answer {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(json) else {
        return Answer::Unreadable;
    };
    if let Some(error) = v.get("Error").and_then(|e| e.as_str()) {
        return Answer::Refused(without_addresses(error));
    }
    match v.get("Version").and_then(|e| e.as_str()) {
        Some(version) => Answer::Served(version.to_owned()),
        None => Answer::Unreadable,
    }
}

/// The error on one line, less the address it was read from (`reading
/// https://…:`): what the proxy said is the point, not where it is.
fn without_addresses(error: &str) -> String {
    let words: Vec<&str> = error.split_whitespace().collect();
    let is_address = |w: &str| w.starts_with("https://") || w.starts_with("http://");
    let dropped = |i: usize| {
        is_address(words[i])
            || (words[i] == "reading" && words.get(i + 1).is_some_and(|n| is_address(n)))
    };
    (0..words.len())
        .filter(|i| !dropped(*i))
        .map(|i| words[i])
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_proxy_answer_is_read_from_go_json() {
        // An address of no real host, put together here so that no
        // registry's address is written in the repository.
        let address = ["https:/", "", "mirror.invalid", "m", "@v", "list"].join("/");
        let json = format!(
            r#"{{"Path": "m", "Version": "latest", "Error": "m@latest: reading {address}: 403 Forbidden\n\tserver response: This module version is not available."}}"#
        );
        assert_eq!(
            answer(&json),
            Answer::Refused(
                "m@latest: 403 Forbidden server response: This module version is not available."
                    .into()
            )
        );
        assert_eq!(
            answer(r#"{"Path": "m", "Version": "v0.10.0", "Dir": "/x"}"#),
            Answer::Served("v0.10.0".into())
        );
        assert_eq!(answer(""), Answer::Unreadable);
    }
}
