//! What `config/agent/` ships, as `kubectl kustomize` builds it: each
//! part's container, its flags, environment and capabilities, so that the
//! tests run the agent as the manifests would.

use std::{collections::BTreeMap, path::Path};

use k8s_openapi::api::{apps::v1::DaemonSet, core::v1::Container};
use serde::Deserialize as _;

use crate::{HarnessError, Result, kubectl};

/// The agent's two parts, each a DaemonSet of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    /// Reads the GPUs, writes the report.
    Reporter,
    /// Carries out resets and reboots.
    Executor,
}

impl Part {
    pub const BOTH: [Part; 2] = [Part::Reporter, Part::Executor];

    /// Its DaemonSet, and its container there.
    pub fn daemonset(self) -> (&'static str, &'static str) {
        match self {
            Part::Reporter => ("gpuhealth-agent", "agent"),
            Part::Executor => ("gpuhealth-executor", "executor"),
        }
    }

    /// Its `--role`, as the binary takes it.
    pub fn role(self) -> &'static str {
        match self {
            Part::Reporter => "reporter",
            Part::Executor => "executor",
        }
    }
}

/// The flags and literal environment of `part`'s container that the
/// overlay `config/agent/<overlay>` ships, as `kubectl kustomize` builds it.
pub async fn shipped(overlay: &str, part: Part) -> Result<(Vec<String>, BTreeMap<String, String>)> {
    let container = shipped_container(overlay, part).await?;
    let env = container
        .env
        .unwrap_or_default()
        .into_iter()
        .filter_map(|e| Some((e.name, e.value?)))
        .collect();
    Ok((container.args.unwrap_or_default(), env))
}

/// The capabilities `part`'s container of `config/agent/<overlay>` adds
/// (it drops every other), lower-case without `CAP_`, as `setpriv` names
/// them; an error if the container is privileged.
pub async fn shipped_capabilities(overlay: &str, part: Part) -> Result<Vec<String>> {
    let context = shipped_container(overlay, part)
        .await?
        .security_context
        .unwrap_or_default();
    if context.privileged == Some(true) {
        return Err(HarnessError::Invalid(format!(
            "config/agent/{overlay} runs the agent privileged"
        )));
    }
    let capabilities = context.capabilities.unwrap_or_default();
    if capabilities.drop != Some(vec!["ALL".to_owned()]) {
        return Err(HarnessError::Invalid(format!(
            "config/agent/{overlay} does not drop ALL capabilities"
        )));
    }
    Ok(capabilities
        .add
        .unwrap_or_default()
        .iter()
        .map(|c| c.to_lowercase())
        .collect())
}

pub async fn shipped_container(overlay: &str, part: Part) -> Result<Container> {
    let (daemonset, container) = part.daemonset();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../config/agent")
        .join(overlay);
    let built = kubectl(&["kustomize", &dir.display().to_string()]).await?;
    for doc in serde_yaml::Deserializer::from_str(&built) {
        let value = serde_yaml::Value::deserialize(doc)
            .map_err(|e| HarnessError::ClusterStart(format!("the built manifests: {e}")))?;
        if value.get("kind").and_then(|k| k.as_str()) != Some("DaemonSet") {
            continue;
        }
        let ds: DaemonSet = serde_yaml::from_value(value)
            .map_err(|e| HarnessError::ClusterStart(format!("the DaemonSet: {e}")))?;
        if ds.metadata.name.as_deref() != Some(daemonset) {
            continue;
        }
        return ds
            .spec
            .and_then(|s| s.template.spec)
            .and_then(|s| s.containers.into_iter().find(|c| c.name == container))
            .ok_or_else(|| HarnessError::ClusterStart(format!("no {container} container")));
    }
    Err(HarnessError::ClusterStart(format!(
        "config/agent/{overlay} has no DaemonSet {daemonset}"
    )))
}
