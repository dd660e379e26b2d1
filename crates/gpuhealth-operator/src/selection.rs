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

/// Every live policy with its selector parsed once, for passes over many
/// nodes (a selector parsed per node made each budget cost milliseconds at
/// a thousand nodes).
pub struct Parsed(Vec<(Arc<GpuHealthPolicy>, Selector)>);

impl Parsed {
    pub fn new(policies: &[Arc<GpuHealthPolicy>]) -> Parsed {
        Parsed(
            policies
                .iter()
                .filter(|p| p.metadata.deletion_timestamp.is_none())
                .filter_map(|p| {
                    let selector = Selector::try_from(p.spec.node_selector.clone()).ok()?;
                    Some((p.clone(), selector))
                })
                .collect(),
        )
    }

    /// Whether the policy named `name` selects `node`.
    pub fn selects(&self, name: &str, node: &Node) -> bool {
        self.0
            .iter()
            .any(|(p, s)| p.metadata.name.as_deref() == Some(name) && s.matches(node.labels()))
    }

    /// The name of the policy that manages `node`, as [`winner`] decides.
    pub fn winner(&self, node: &Node) -> Option<&str> {
        self.0
            .iter()
            .filter(|(_, s)| s.matches(node.labels()))
            .map(|(p, _)| p)
            .min_by(|a, b| {
                b.spec
                    .priority
                    .cmp(&a.spec.priority)
                    .then_with(|| a.name_any().cmp(&b.name_any()))
            })
            .and_then(|p| p.metadata.name.as_deref())
    }
}
