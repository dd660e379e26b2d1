//! Which policy manages a node when selectors overlap: the highest priority,
//! then the name; and which nodes each policy manages.

use std::{collections::BTreeMap, sync::Arc};

use gpuhealth_api::GpuHealthPolicy;
use k8s_openapi::api::core::v1::Node;
use kube::{
    ResourceExt,
    core::{Selector, SelectorExt},
};

use crate::context::Context;

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

/// The nodes of `nodes` that `policy` manages (the policy that wins them).
pub fn managed_by<'n>(
    ctx: &Context,
    policy: &GpuHealthPolicy,
    nodes: &'n [Arc<Node>],
) -> impl Iterator<Item = &'n Arc<Node>> {
    let name = policy.name_any();
    let parsed = Parsed::new(&ctx.policies.state());
    nodes
        .iter()
        .filter(move |n| parsed.winner(n) == Some(name.as_str()))
}

/// How many nodes `policy` manages, and for the nodes it selects but
/// another policy wins, how many each winner took.
pub fn managed(ctx: &Context, policy: &GpuHealthPolicy) -> (usize, Vec<(String, usize)>) {
    let name = policy.name_any();
    let parsed = Parsed::new(&ctx.policies.state());
    let mut managed = 0;
    let mut lost: BTreeMap<String, usize> = BTreeMap::new();
    for node in ctx
        .nodes
        .state()
        .iter()
        .filter(|n| parsed.selects(&name, n))
    {
        match parsed.winner(node) {
            Some(w) if w == name => managed += 1,
            Some(w) => *lost.entry(w.to_owned()).or_default() += 1,
            None => {}
        }
    }
    (managed, lost.into_iter().collect())
}
