//! What `config/agent/` ships, as `kubectl kustomize` builds it: the agent
//! container's flags, environment and capabilities, so that the tests run
//! the agent as the manifests would.

use std::{collections::BTreeMap, path::Path};

use k8s_openapi::api::{apps::v1::DaemonSet, core::v1::Container};
use serde::Deserialize as _;

use crate::{HarnessError, Result, kubectl};

/// The flags and literal environment of the agent container that the
/// overlay `config/agent/<overlay>` ships, as `kubectl kustomize` builds it.
pub async fn shipped(overlay: &str) -> Result<(Vec<String>, BTreeMap<String, String>)> {
    let container = shipped_container(overlay).await?;
    let env = container
        .env
        .unwrap_or_default()
        .into_iter()
        .filter_map(|e| Some((e.name, e.value?)))
        .collect();
    Ok((container.args.unwrap_or_default(), env))
}

/// The capabilities the agent container of `config/agent/<overlay>` adds
/// (it drops every other), lower-case without `CAP_`, as `setpriv` names
/// them; an error if the container is privileged.
pub async fn shipped_capabilities(overlay: &str) -> Result<Vec<String>> {
    let context = shipped_container(overlay)
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

pub async fn shipped_container(overlay: &str) -> Result<Container> {
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
        return ds
            .spec
            .and_then(|s| s.template.spec)
            .and_then(|s| s.containers.into_iter().find(|c| c.name == "agent"))
            .ok_or_else(|| HarnessError::ClusterStart("no agent container".into()));
    }
    Err(HarnessError::ClusterStart(format!(
        "config/agent/{overlay} has no DaemonSet"
    )))
}
