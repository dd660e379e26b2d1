//! Which policy manages a node when selectors overlap: the highest priority,
//! then the name.

use std::sync::Arc;

use gpuhealth_api::GpuHealthPolicy;
use k8s_openapi::api::core::v1::Node;
use kube::{
    ResourceExt,
    core::{Selector, SelectorExt},
};

/// Whether `policy` selects `node`. A selector that does not parse selects
/// nothing: bad input never triggers an action.
pub fn selects(policy: &GpuHealthPolicy, node: &Node) -> bool {
    Selector::try_from(policy.spec.node_selector.clone()).is_ok_and(|s| s.matches(node.labels()))
}

/// The policy that manages `node`, if any.
pub fn winner(policies: &[Arc<GpuHealthPolicy>], node: &Node) -> Option<Arc<GpuHealthPolicy>> {
    policies
        .iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none() && selects(p, node))
        .min_by(|a, b| {
            b.spec
                .priority
                .cmp(&a.spec.priority)
                .then_with(|| a.name_any().cmp(&b.name_any()))
        })
        .cloned()
}
