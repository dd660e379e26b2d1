//! Bounds a cluster's administrator sets on every policy, which a policy
//! author cannot lift (they are the operator's flags, not the policy's
//! fields): namespaces no drain evicts from, the most nodes disrupted at
//! once across all policies, the most nodes a policy may select in
//! `Enforce` before it must say `acknowledgeFleetWide`, and which node
//! condition types a policy may act on. A policy past one enforces nothing
//! and its `Ready` condition names the bound.

use gpuhealth_api::policy::{GpuHealthPolicySpec, Mode};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::{budget, problem::Problem};

/// The node condition types policies may act on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ConditionTypes {
    Any,
    Only(Vec<String>),
}

impl ConditionTypes {
    fn allows(&self, type_: &str) -> bool {
        match self {
            ConditionTypes::Any => true,
            ConditionTypes::Only(types) => types.iter().any(|t| t == type_),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Guardrails {
    /// Namespaces no drain evicts from, whatever a policy's
    /// `excludeNamespaces` says.
    pub never_drain: Vec<String>,
    /// The most nodes disrupted at once across all policies: a count, or a
    /// percentage of every node a policy manages (never below one).
    pub max_disrupted: IntOrString,
    /// The most nodes a policy may select in `Enforce` without
    /// `acknowledgeFleetWide`; None: no bound.
    pub fleet_wide: Option<usize>,
    pub condition_types: ConditionTypes,
}

impl Guardrails {
    /// No bound at all.
    pub fn none() -> Self {
        Guardrails {
            never_drain: Vec::new(),
            max_disrupted: IntOrString::String("100%".into()),
            fleet_wide: None,
            condition_types: ConditionTypes::Any,
        }
    }

    /// Where `spec`, selecting `selected` nodes, is past a bound: each a
    /// problem naming its field and the bound. Any one, and the policy
    /// enforces nothing.
    pub fn exceeded(&self, spec: &GpuHealthPolicySpec, selected: usize) -> Vec<Problem> {
        let mut out = Vec::new();
        if let Some(bound) = self.fleet_wide
            && spec.mode == Mode::Enforce
            && selected > bound
            && !spec.acknowledge_fleet_wide
        {
            out.push(Problem::new(
                "spec.acknowledgeFleetWide",
                format!(
                    "the policy selects {selected} nodes in Enforce, more than the cluster's fleet-wide bound ({bound}, --fleet-wide-nodes): set acknowledgeFleetWide: true if that is meant"
                ),
            ));
        }
        for (i, rule) in spec.detection.node_conditions.iter().enumerate() {
            if !self.condition_types.allows(&rule.type_) {
                out.push(Problem::new(
                    format!("spec.detection.nodeConditions[{i}].type"),
                    format!(
                        "the cluster's guardrails do not let a policy act on {} (--condition-types)",
                        rule.type_
                    ),
                ));
            }
        }
        out
    }

    /// The most nodes disrupted at once across all policies, of `managed`.
    pub fn max_disrupted(&self, managed: usize) -> usize {
        budget::resolve_down(&self.max_disrupted, managed).max(1)
    }

    /// Whether a drain leaves the namespace alone.
    pub fn never_drains(&self, namespace: &str) -> bool {
        self.never_drain.iter().any(|n| n == namespace)
    }
}

#[cfg(test)]
mod tests {
    use gpuhealth_api::{
        policy::{ConditionRule, ConditionStatus, ConditionWriter},
        types::SignalAction,
    };
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

    use super::*;

    fn bounded() -> Guardrails {
        Guardrails {
            never_drain: vec!["kube-system".into()],
            max_disrupted: IntOrString::String("10%".into()),
            fleet_wide: Some(100),
            condition_types: ConditionTypes::Only(vec!["SysLogsXIDError".into()]),
        }
    }

    fn condition(type_: &str) -> ConditionRule {
        ConditionRule {
            type_: type_.into(),
            status: ConditionStatus::True,
            for_: gpuhealth_api::Duration::from_secs(0),
            action: SignalAction::GpuReset,
            writers: vec![ConditionWriter::group("system:nodes")],
        }
    }

    #[test]
    fn a_policy_within_every_bound_is_past_none() {
        let mut spec = GpuHealthPolicySpec::for_selector(LabelSelector::default());
        spec.detection.node_conditions = vec![condition("SysLogsXIDError")];
        assert!(bounded().exceeded(&spec, 100).is_empty());
        assert!(Guardrails::none().exceeded(&spec, 100_000).is_empty());
    }

    #[test]
    fn fleet_wide_needs_saying_in_enforce_only() {
        let mut spec = GpuHealthPolicySpec::for_selector(LabelSelector::default());
        let past = bounded().exceeded(&spec, 101);
        assert_eq!(past.len(), 1);
        assert_eq!(past[0].field, "spec.acknowledgeFleetWide");
        assert!(
            past[0].to_string().contains("selects 101 nodes"),
            "{}",
            past[0]
        );
        spec.acknowledge_fleet_wide = true;
        assert!(bounded().exceeded(&spec, 5000).is_empty());
        spec.acknowledge_fleet_wide = false;
        spec.mode = Mode::DryRun;
        assert!(
            bounded().exceeded(&spec, 5000).is_empty(),
            "DryRun disrupts nothing"
        );
    }

    #[test]
    fn a_condition_type_the_cluster_does_not_allow_is_named() {
        let mut spec = GpuHealthPolicySpec::for_selector(LabelSelector::default());
        spec.detection.node_conditions = vec![condition("SysLogsXIDError"), condition("Ready")];
        let past = bounded().exceeded(&spec, 3);
        assert_eq!(past.len(), 1);
        assert_eq!(past[0].field, "spec.detection.nodeConditions[1].type");
    }

    #[test]
    fn the_most_disrupted_is_a_share_of_the_fleet_never_below_one() {
        assert_eq!(bounded().max_disrupted(1000), 100);
        assert_eq!(bounded().max_disrupted(3), 1);
        assert_eq!(Guardrails::none().max_disrupted(7), 7);
    }
}
