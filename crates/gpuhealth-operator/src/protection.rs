//! Whether the install's admission protection is in force, checked rather
//! than assumed. Without it (a cluster before 1.30, a failed sync, a
//! deleted binding) anyone who may patch Nodes could forge a report and
//! drive the ladder, so gpuhealth then enforces nothing: every step holds
//! (`Reason::Unprotected`), every policy says why in `Ready=False`, and
//! `gpuhealth_protected` is 0 (alert `GpuHealthUnprotected`).
//!
//! Checked at start and every `--admission-check-interval`: each policy the
//! install ships (known by its `gpuhealth.io/protects` label, so that a
//! kustomize `nameSuffix:` keeps it found) exists with a binding that
//! denies, and a server-side dry run of a write the operator may not make
//! (an agent's report, a maintenance notice) on a Node is refused. And
//! admission guards every node condition type the operator may act on:
//! the install writes the guardrail into `gpuhealth-trusted-conditions`
//! from the same value the operator reads, and an overlay that changed one
//! and not the other would leave a type the operator acts on open to
//! anyone who may patch a Node's status.

use std::{sync::Arc, time::Duration};

use futures::channel::mpsc::UnboundedSender;
use gpuhealth_api::{
    contract::{GPU_REPORT_ANNOTATION, MAINTENANCE_ANNOTATION},
    policy::RESERVED_CONDITION_TYPES,
};
use gpuhealth_engine::guardrails::ConditionTypes;
use k8s_openapi::{
    api::{
        admissionregistration::v1::{ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding},
        core::v1::Node,
    },
    jiff::Timestamp,
};
use kube::{
    Api, Client, ResourceExt,
    api::{ListParams, Patch, PatchParams},
};
use parking_lot::RwLock;
use serde_json::json;
use tracing::{error, info, warn};

use crate::metrics::Metrics;

/// The label each shipped admission policy carries, naming what it guards.
pub const PROTECTS_LABEL: &str = "gpuhealth.io/protects";

/// What the install's policies guard, by their `gpuhealth.io/protects`
/// label: each must exist and be bound to deny.
pub const GUARDS: [&str; 9] = [
    "operator-keys",
    "operator-pods",
    "operator-records",
    "agent-keys",
    "maintenance-notice",
    "device-taint-rules",
    "agent-own-node",
    "agent-events",
    "trusted-conditions",
];

/// The operator's view of its protection, shared by every reconcile.
pub struct Protection {
    /// Why it is not in force; `None` once a check found it is.
    missing: RwLock<Option<String>>,
    /// Whether checks run at all (`--skip-admission-check`: never).
    checked: bool,
}

impl Protection {
    /// Not in force until the first check says it is.
    pub fn new(checked: bool) -> Self {
        let missing = checked.then(|| "the admission protection has not been checked yet".into());
        Protection {
            missing: RwLock::new(missing),
            checked,
        }
    }

    /// Why nothing may be enforced now, if so.
    pub fn missing(&self) -> Option<String> {
        self.missing.read().clone()
    }

    /// Records a check's finding; true if it changed.
    fn set(&self, now: Option<String>) -> bool {
        let mut missing = self.missing.write();
        let changed = *missing != now;
        *missing = now;
        changed
    }
}

/// Checks now and every `every`, admission guarding each of the
/// `condition_types` the operator may act on; on each change, says so in
/// the log and on each of `changed` (the nodes' and the policies'
/// reconciles).
pub async fn watch(
    client: Client,
    protection: Arc<Protection>,
    metrics: Arc<Metrics>,
    every: Duration,
    condition_types: ConditionTypes,
    changed: Vec<UnboundedSender<()>>,
) {
    if !protection.checked {
        warn!(
            "--skip-admission-check: gpuhealth acts without checking that its admission policies are in force; anyone who may patch Nodes may be able to drive it"
        );
        return;
    }
    loop {
        let found = match check(&client, &condition_types).await {
            Ok(()) => Some(None),
            Err(Check::Missing(why)) => Some(Some(why)),
            Err(Check::Inconclusive(e)) => {
                warn!(error = %e, "could not check the admission protection: will try again");
                None
            }
        };
        if let Some(now) = found {
            metrics.protected.set(i64::from(now.is_none()));
            if protection.set(now.clone()) {
                match &now {
                    None => info!("admission protection in force: enforcing"),
                    Some(why) => {
                        error!(why = %why, "admission protection not in force: enforcing nothing")
                    }
                }
                for tx in &changed {
                    let _ = tx.unbounded_send(());
                }
            }
        }
        tokio::time::sleep(every).await;
    }
}

enum Check {
    /// Protection is not in force, and why.
    Missing(String),
    /// The check itself failed (the API server unreachable, say).
    Inconclusive(kube::Error),
}

impl From<kube::Error> for Check {
    fn from(e: kube::Error) -> Self {
        Check::Inconclusive(e)
    }
}

async fn check(client: &Client, condition_types: &ConditionTypes) -> Result<(), Check> {
    let policies = Api::<ValidatingAdmissionPolicy>::all(client.clone())
        .list(&ListParams::default().labels(PROTECTS_LABEL))
        .await?;
    let bindings = Api::<ValidatingAdmissionPolicyBinding>::all(client.clone())
        .list(&ListParams::default())
        .await?;
    let unguarded: Vec<&str> = GUARDS
        .into_iter()
        .filter(|guard| {
            !policies
                .items
                .iter()
                .filter(|p| p.labels().get(PROTECTS_LABEL).map(String::as_str) == Some(guard))
                .any(|p| denies(&p.name_any(), &bindings.items))
        })
        .collect();
    if !unguarded.is_empty() {
        return Err(Check::Missing(format!(
            "no admission policy bound to deny guards {} (labelled {PROTECTS_LABEL}; config/admission and the agent's overlay ship them)",
            unguarded.join(", ")
        )));
    }
    let guarded: Vec<Guarded> = policies
        .items
        .iter()
        .filter(|p| p.labels().get(PROTECTS_LABEL).map(String::as_str) == Some(TRUSTED_CONDITIONS))
        .filter(|p| denies(&p.name_any(), &bindings.items))
        .map(guarded_types)
        .collect();
    let open = unguarded_types(condition_types, &guarded);
    if !open.is_empty() {
        return Err(Check::Missing(format!(
            "the operator may act on the node condition types {} (GPUHEALTH_CONDITION_TYPES, --condition-types), which no bound {TRUSTED_CONDITIONS} admission policy guards: anyone who may patch a Node's status could write them; set both from one value (the ConfigMap gpuhealth-guardrails), then restart the operator",
            open.join(", ")
        )));
    }
    // Present is not proof: a write the operator may not make must be
    // refused. Any Node will do; with none there is nothing to protect.
    let nodes: Api<Node> = Api::all(client.clone());
    let Some(node) = nodes
        .list(&ListParams::default().limit(1))
        .await?
        .items
        .into_iter()
        .next()
    else {
        return Ok(());
    };
    let probe = json!({"probe": Timestamp::now().to_string()}).to_string();
    for key in [GPU_REPORT_ANNOTATION, MAINTENANCE_ANNOTATION] {
        let patch = json!({"metadata": {"annotations": {key: probe}}});
        let params = PatchParams {
            dry_run: true,
            ..PatchParams::default()
        };
        match nodes
            .patch(&node.name_any(), &params, &Patch::Merge(&patch))
            .await
        {
            Err(kube::Error::Api(e)) if matches!(e.code, 400 | 403 | 422) => {}
            Err(e) => return Err(e.into()),
            Ok(_) => {
                return Err(Check::Missing(format!(
                    "a dry run of the operator writing {key} on Node {} was let through: the admission policies are not in force",
                    node.name_any()
                )));
            }
        }
    }
    Ok(())
}

/// The guard of a node condition a policy acts on (`GUARDS`).
const TRUSTED_CONDITIONS: &str = "trusted-conditions";
/// Its variable holding the guardrail, as the install writes it:
/// `'SysLogsXIDError,AcceleratedHardwareReady'.split(',')`.
const GUARDRAIL_VARIABLE: &str = "conditionTypes";

/// The condition types one trusted-conditions policy guards.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Guarded {
    /// Every type a policy acts on: `*`, or a policy from before the
    /// guardrail reached admission (it has no such variable).
    Every,
    /// These only (none where its variable cannot be read).
    Only(Vec<String>),
}

fn guarded_types(policy: &ValidatingAdmissionPolicy) -> Guarded {
    let variables = policy.spec.as_ref().and_then(|s| s.variables.as_ref());
    let Some(variable) = variables.and_then(|v| v.iter().find(|v| v.name == GUARDRAIL_VARIABLE))
    else {
        return Guarded::Every;
    };
    let literal = variable
        .expression
        .trim()
        .strip_prefix('\'')
        .and_then(|e| e.strip_suffix("'.split(',')"));
    let Some(literal) = literal.filter(|l| !l.contains('\'')) else {
        return Guarded::Only(Vec::new());
    };
    let types: Vec<String> = literal
        .split(',')
        .filter(|t| !t.is_empty())
        .map(str::to_owned)
        .collect();
    if types.iter().any(|t| t == "*") {
        Guarded::Every
    } else {
        Guarded::Only(types)
    }
}

/// The condition types the operator may act on that none of `guarded`
/// guards (`*` for any, where the operator may act on any). Reserved
/// types are left out: the operator never acts on them, and admission
/// never guards them.
fn unguarded_types(allowed: &ConditionTypes, guarded: &[Guarded]) -> Vec<String> {
    if guarded.contains(&Guarded::Every) {
        return Vec::new();
    }
    let guards = |t: &str| {
        guarded
            .iter()
            .any(|g| matches!(g, Guarded::Only(types) if types.iter().any(|x| x == t)))
    };
    match allowed {
        ConditionTypes::Any => vec!["*".to_owned()],
        ConditionTypes::Only(types) => types
            .iter()
            .filter(|t| !RESERVED_CONDITION_TYPES.contains(&t.as_str()) && !guards(t))
            .cloned()
            .collect(),
    }
}

/// Whether a binding of `policy` denies what it refuses.
fn denies(policy: &str, bindings: &[ValidatingAdmissionPolicyBinding]) -> bool {
    bindings.iter().any(|b| {
        b.spec.policy_name == policy && b.spec.validation_actions.iter().any(|a| a == "Deny")
    })
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::admissionregistration::v1::{ValidatingAdmissionPolicySpec, Variable};

    use super::*;

    fn policy(guardrail: Option<&str>) -> ValidatingAdmissionPolicy {
        let variable = |name: &str, expression: &str| Variable {
            name: name.into(),
            expression: expression.into(),
        };
        let mut variables = vec![variable("rules", "[]")];
        variables.extend(guardrail.map(|e| variable(GUARDRAIL_VARIABLE, e)));
        ValidatingAdmissionPolicy {
            spec: Some(ValidatingAdmissionPolicySpec {
                variables: Some(variables),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn only(types: &[&str]) -> ConditionTypes {
        ConditionTypes::Only(types.iter().map(|t| (*t).to_owned()).collect())
    }

    #[test]
    fn the_guardrail_is_read_as_the_install_writes_it() {
        let read = |e: &str| guarded_types(&policy(Some(e)));
        assert_eq!(
            read("'SysLogsXIDError,AcceleratedHardwareReady'.split(',')"),
            Guarded::Only(vec![
                "SysLogsXIDError".into(),
                "AcceleratedHardwareReady".into()
            ])
        );
        assert_eq!(read("''.split(',')"), Guarded::Only(Vec::new()));
        assert_eq!(read("'*'.split(',')"), Guarded::Every);
        // Not as the install writes it: nothing is taken as guarded.
        assert_eq!(read("['SysLogsXIDError']"), Guarded::Only(Vec::new()));
        assert_eq!(read("'a','b'.split(',')"), Guarded::Only(Vec::new()));
        // A policy from before the guardrail reached admission guards every type.
        assert_eq!(guarded_types(&policy(None)), Guarded::Every);
    }

    #[test]
    fn every_type_the_operator_may_act_on_must_be_guarded() {
        let syslog = Guarded::Only(vec!["SysLogsXIDError".into()]);
        let none = Guarded::Only(Vec::new());
        assert!(unguarded_types(&only(&[]), std::slice::from_ref(&none)).is_empty());
        assert!(
            unguarded_types(&only(&["SysLogsXIDError"]), &[none.clone(), syslog.clone()])
                .is_empty()
        );
        assert_eq!(
            unguarded_types(
                &only(&["SysLogsXIDError", "Other"]),
                std::slice::from_ref(&syslog)
            ),
            ["Other"]
        );
        assert_eq!(
            unguarded_types(&only(&["SysLogsXIDError"]), &[]),
            ["SysLogsXIDError"]
        );
        assert_eq!(unguarded_types(&ConditionTypes::Any, &[syslog]), ["*"]);
        assert!(unguarded_types(&ConditionTypes::Any, &[none, Guarded::Every]).is_empty());
        // The operator never acts on a reserved type: nothing to guard.
        assert!(unguarded_types(&only(&["Ready", "GpuHealthy"]), &[]).is_empty());
    }
}
