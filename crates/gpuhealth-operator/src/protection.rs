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
//! (an agent's report, a maintenance notice) on a Node is refused.

use std::{
    sync::{Arc, RwLock},
    time::Duration,
};

use futures::channel::mpsc::UnboundedSender;
use gpuhealth_api::contract::{GPU_REPORT_ANNOTATION, MAINTENANCE_ANNOTATION};
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
use serde_json::json;
use tracing::{error, info, warn};

use crate::metrics::Metrics;

/// The label each shipped admission policy carries, naming what it guards.
pub const PROTECTS_LABEL: &str = "gpuhealth.io/protects";

/// What the install's policies guard, by their `gpuhealth.io/protects`
/// label: each must exist and be bound to deny.
pub const GUARDS: [&str; 8] = [
    "operator-keys",
    "operator-pods",
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
        self.missing
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Records a check's finding; true if it changed.
    fn set(&self, now: Option<String>) -> bool {
        let mut missing = self.missing.write().unwrap_or_else(|e| e.into_inner());
        let changed = *missing != now;
        *missing = now;
        changed
    }
}

/// Checks now and every `every`; on each change, says so in the log and
/// on each of `changed` (the nodes' and the policies' reconciles).
pub async fn watch(
    client: Client,
    protection: Arc<Protection>,
    metrics: Arc<Metrics>,
    every: Duration,
    changed: Vec<UnboundedSender<()>>,
) {
    if !protection.checked {
        warn!(
            "--skip-admission-check: gpuhealth acts without checking that its admission policies are in force; anyone who may patch Nodes may be able to drive it"
        );
        return;
    }
    loop {
        let found = match check(&client).await {
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

async fn check(client: &Client) -> Result<(), Check> {
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

/// Whether a binding of `policy` denies what it refuses.
fn denies(policy: &str, bindings: &[ValidatingAdmissionPolicyBinding]) -> bool {
    bindings.iter().any(|b| {
        b.spec.policy_name == policy && b.spec.validation_actions.iter().any(|a| a == "Deny")
    })
}
