//! The policies the benchmark applies.

use gpuhealth_api::{
    GpuHealthPolicy, GpuHealthPolicySpec,
    policy::{ConditionRule, ConditionStatus, ConditionWriter, Mode},
    types::SignalAction,
};
use gpuhealth_e2e::sim::SIM_GROUP_LABEL;
use k8s_openapi::apimachinery::pkg::{
    apis::meta::v1::{LabelSelector, LabelSelectorRequirement},
    util::intstr::IntOrString,
};
use kube::{
    Api, Client,
    api::{Patch, PatchParams, PostParams},
};
use serde_json::json;

use crate::{Result, measure::POLICY, peer, watch};

/// The benchmark's policy for simulation group `group`: Enforce, no
/// cooldown or aftercare, so that only the reaction is measured.
pub fn policy(group: &str, max_concurrent: &str) -> GpuHealthPolicy {
    let mut spec = GpuHealthPolicySpec::for_selector(LabelSelector {
        match_labels: Some([(SIM_GROUP_LABEL.to_owned(), group.to_owned())].into()),
        match_expressions: Some(vec![
            LabelSelectorRequirement {
                key: watch::FLOOR_LABEL.into(),
                operator: "DoesNotExist".into(),
                values: None,
            },
            // The nodes left to the peer in a comparison.
            LabelSelectorRequirement {
                key: peer::SIDE_LABEL.into(),
                operator: "NotIn".into(),
                values: Some(vec![peer::Side::Nhc.label().into()]),
            },
        ]),
    });
    spec.mode = Mode::Enforce;
    spec.max_concurrent = IntOrString::String(max_concurrent.into());
    spec.max_unhealthy = IntOrString::String("100%".into());
    spec.verification.stable_for = gpuhealth_api::Duration::from_secs(3);
    spec.verification.workload_recovery_timeout = gpuhealth_api::Duration::from_secs(0);
    spec.remediation_limits.cooldown = gpuhealth_api::Duration::from_secs(0);
    // The simulated fleet's reports are written once, and no agent
    // refreshes them: left at 15 minutes, every idle node's report went
    // stale during the storm, and 1,000 StaleReport findings and Events
    // were counted as the storm's cost (bench/FINDINGS.md).
    spec.detection.gpu_report.stale_after = gpuhealth_api::Duration::from_secs(24 * 3600);
    // The signal the peer reacts to, taken as it does: at once. A
    // condition names no GPU: every GPU of the node is reset.
    spec.detection.node_conditions = vec![ConditionRule {
        type_: watch::CONDITION.into(),
        status: ConditionStatus::False,
        for_: gpuhealth_api::Duration::from_secs(0),
        action: SignalAction::GpuReset,
        // The bench writes the condition as the cluster's administrator.
        writers: vec![ConditionWriter::group("system:masters")],
    }];
    // Each policy is named after the simulation group it selects.
    GpuHealthPolicy::new(group, spec)
}

/// Creates `group`'s policy with `spec` merged over the benchmark's own.
pub async fn create_policy(client: &Client, group: &str, spec: serde_json::Value) -> Result<()> {
    let mut policy = policy(group, "1");
    let mut value = serde_json::to_value(&policy.spec)?;
    merge(&mut value, spec);
    policy.spec = serde_json::from_value(value)?;
    Api::<GpuHealthPolicy>::all(client.clone())
        .create(&PostParams::default(), &policy)
        .await?;
    Ok(())
}

fn merge(into: &mut serde_json::Value, from: serde_json::Value) {
    match (into, from) {
        (serde_json::Value::Object(a), serde_json::Value::Object(b)) => {
            for (k, v) in b {
                merge(a.entry(k).or_insert(serde_json::Value::Null), v);
            }
        }
        (into, from) => *into = from,
    }
}

/// Merge-patches the policy's `spec` with `spec`: a patch, not a replace
/// of what was read, which would conflict with the operator's writes of
/// the policy's status.
pub async fn set_policy(policies: &Api<GpuHealthPolicy>, spec: serde_json::Value) -> Result<()> {
    policies
        .patch(
            POLICY,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": spec})),
        )
        .await?;
    Ok(())
}

/// Replaces the policy's whole spec, so that what the earlier phases set
/// goes too; read again when a write of the operator's came between the
/// read and the replace.
pub async fn replace_spec(
    policies: &Api<GpuHealthPolicy>,
    spec: gpuhealth_api::GpuHealthPolicySpec,
) -> Result<()> {
    for _ in 0..10 {
        let mut current = policies.get(POLICY).await?;
        current.spec = spec.clone();
        match policies
            .replace(POLICY, &PostParams::default(), &current)
            .await
        {
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            replaced => return replaced.map(|_| ()).map_err(Into::into),
        }
    }
    Err("the policy changed under ten replaces in a row".into())
}
