//! What the API server serves, asked once at start: the operator adapts to
//! the cluster (DRA, and the version of `DeviceTaintRule`) rather than fail
//! where an API is off.

use kube::Client;
use tracing::warn;

/// Whether the cluster serves `resource` in `group_version`.
pub async fn served(client: &Client, group_version: &str, resource: &str) -> bool {
    match client.list_api_group_resources(group_version).await {
        Ok(list) => list.resources.iter().any(|r| r.name == resource),
        Err(kube::Error::Api(_)) => false,
        Err(e) => {
            warn!(error = %e, group_version, resource, "could not ask whether the cluster serves it; taking it that it does not");
            false
        }
    }
}
