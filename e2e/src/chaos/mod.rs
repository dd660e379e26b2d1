//! `make chaos` (issue 9): scenarios that try hard to break the operator on
//! the real local cluster (kills, restarts, conflicting writers, storms),
//! each judged afterwards by [`crate::invariants::check`] over what the
//! [`crate::recorder::Recorder`] saw. Every scenario reports one [`Row`].

pub mod conflicts;
pub mod fence_kills;
pub mod fencing;
pub mod fleet;
pub mod hostile;
pub mod kill;
pub mod lag;
pub mod newcomers;
pub mod restarts;
pub mod storm;
pub mod upgrade;

/// The phases every fault passes through: where a kill, an upgrade or a
/// takeover may land.
pub const REMEDIATION_PHASES: [gpuhealth_api::node_health::Phase; 4] = [
    gpuhealth_api::node_health::Phase::Quarantined,
    gpuhealth_api::node_health::Phase::Draining,
    gpuhealth_api::node_health::Phase::Remediating,
    gpuhealth_api::node_health::Phase::Verifying,
];

use std::{fmt::Write as _, time::Duration};

use gpuhealth_agent::fake::{SimHardware, SimOutcome};
use gpuhealth_api::{
    GpuHealth, GpuHealthPolicySpec, contract::DISRUPTION_TOLERANCE_ANNOTATION, node_health::Phase,
};
use k8s_openapi::{
    api::core::v1::{Container, Node, Pod, PodSpec},
    apimachinery::pkg::{apis::meta::v1::ObjectMeta, util::intstr::IntOrString},
};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, Patch, PatchParams, PostParams},
};
use serde_json::json;

use crate::{
    Result,
    invariants::{Expectations, Violation},
    node_agent::hardware,
    reports,
    scenario::Scenario,
    sim::set_cordon,
};
use gpuhealth_agent::fake::SIM_HARDWARE_ANNOTATION;

/// A small, seeded pseudo-random source (SplitMix64): a run is repeated by
/// passing the seed it printed.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// A duration in `0..max`, to the millisecond.
    pub fn within(&mut self, max: Duration) -> Duration {
        Duration::from_millis(self.next_u64() % max.as_millis().max(1) as u64)
    }

    /// `k` distinct items of `from`, in random order.
    pub fn pick<T: Clone>(&mut self, from: &[T], k: usize) -> Vec<T> {
        let mut pool = from.to_vec();
        let mut out = Vec::new();
        while out.len() < k && !pool.is_empty() {
            out.push(pool.swap_remove(self.below(pool.len())));
        }
        out
    }
}

/// A fault put on one node's simulated hardware, and how the node must end.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The incident (Xid 119, then 154 asking for a reset); the reset works.
    ResetHeals,
    /// The reset fails; the reboot it escalates to works.
    RebootHeals,
    /// Neither works: escalation is exhausted.
    Hopeless,
    /// The bad GPU is held by a pod whose tolerance is `never`: the drain
    /// cannot finish, and the node is handed to a person.
    NeverPodHolds,
}

impl Fault {
    pub const ALL: [Fault; 4] = [
        Fault::ResetHeals,
        Fault::RebootHeals,
        Fault::Hopeless,
        Fault::NeverPodHolds,
    ];

    pub fn ending(self) -> Phase {
        match self {
            Fault::ResetHeals | Fault::RebootHeals => Phase::Healthy,
            Fault::Hopeless | Fault::NeverPodHolds => Phase::Failed,
        }
    }
}

/// The policy chaos runs under: quick verification, no repeat limits or
/// cooldown (the same nodes fail trial after trial), a short drain timeout
/// (a `never` pod ends a drain in seconds), `maxConcurrent` as given.
pub fn policy(max_concurrent: i32, max_unhealthy: IntOrString) -> GpuHealthPolicySpec {
    let mut spec = Scenario::quick_spec();
    spec.max_concurrent = IntOrString::Int(max_concurrent);
    spec.max_unhealthy = max_unhealthy;
    spec.remediation_limits.per_gpu = 0;
    spec.remediation_limits.per_node = 0;
    spec.remediation_limits.cooldown = gpuhealth_api::Duration::from_secs(0);
    spec.drain.timeout = gpuhealth_api::Duration::from_secs(15);
    spec
}

/// Changes `node`'s simulated hardware with `change`, guarded by the
/// node's resourceVersion so that a concurrent write by the agent (a
/// request carried out) is never overwritten: on a conflict, read again.
pub async fn update_hardware(
    client: &Client,
    node: &str,
    change: impl Fn(&mut SimHardware),
) -> Result<()> {
    let api: Api<Node> = Api::all(client.clone());
    loop {
        let current = api.get(node).await?;
        let Some(mut hw) = hardware(&current) else {
            return Err(crate::HarnessError::ClusterStart(format!(
                "{node} has no simulated hardware"
            )));
        };
        change(&mut hw);
        let patch = json!({"metadata": {
            "resourceVersion": current.resource_version(),
            "annotations": {SIM_HARDWARE_ANNOTATION: serde_json::to_string(&hw)?},
        }});
        match api
            .patch(node, &PatchParams::default(), &Patch::Merge(patch))
            .await
        {
            Err(kube::Error::Api(e)) if e.code == 409 => continue,
            result => return result.map(|_| ()).map_err(Into::into),
        }
    }
}

/// Puts `fault` on GPU `gpu` of `node`; for [`Fault::NeverPodHolds`], first
/// creates the `never` pod (named `holder`) that holds it.
pub async fn inject(
    s: &Scenario,
    node: &str,
    gpu: usize,
    fault: Fault,
    holder: &str,
) -> Result<()> {
    if fault == Fault::NeverPodHolds {
        never_pod(&s.client, &s.namespace, node, holder).await?;
    }
    let namespace = s.namespace.clone();
    let holder = holder.to_owned();
    update_hardware(&s.client, node, move |hw| {
        let mut report = reports::healthy(&namespace, &[]);
        report.gpus = std::mem::take(&mut hw.gpus);
        reports::xid_119_and_154(&mut report, gpu);
        if fault == Fault::NeverPodHolds
            && let Some(g) = report.gpus.get_mut(gpu)
        {
            g.pods.push(gpuhealth_api::contract::PodRef {
                namespace: namespace.clone(),
                name: holder.clone(),
                container: Some("train".into()),
            });
        }
        hw.gpus = report.gpus;
        (hw.reset, hw.reboot) = match fault {
            Fault::ResetHeals => (SimOutcome::Succeed, SimOutcome::Succeed),
            Fault::RebootHeals => (SimOutcome::Fail, SimOutcome::Succeed),
            Fault::Hopeless | Fault::NeverPodHolds => (SimOutcome::Fail, SimOutcome::Fail),
        };
    })
    .await
}

/// What a person does for a `Failed` node: mends the hardware, deletes the
/// pod that held it, and uncordons it.
pub async fn repair(s: &Scenario, node: &str, holder: &str) -> Result<()> {
    let pods: Api<Pod> = Api::namespaced(s.client.clone(), &s.namespace);
    match pods
        .delete(holder, &DeleteParams::default().grace_period(0))
        .await
    {
        Ok(_) => {}
        Err(kube::Error::Api(e)) if e.code == 404 => {}
        Err(e) => return Err(e.into()),
    }
    update_hardware(&s.client, node, |hw| {
        for g in &mut hw.gpus {
            g.health = GpuHealth::Healthy;
            g.recovery_action = Some(0);
            g.xids.clear();
            g.pods.retain(|p| p.name != holder);
        }
        hw.reset = SimOutcome::Succeed;
        hw.reboot = SimOutcome::Succeed;
    })
    .await?;
    set_cordon(&s.client, node, false).await?;
    Ok(())
}

/// A bare pod on `node` that must never be evicted (a training job
/// without checkpoints).
async fn never_pod(client: &Client, namespace: &str, node: &str, name: &str) -> Result<()> {
    let pod = Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            annotations: Some(
                [(
                    DISRUPTION_TOLERANCE_ANNOTATION.to_owned(),
                    "never".to_owned(),
                )]
                .into(),
            ),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            containers: vec![Container {
                name: "train".into(),
                image: Some("registry.example/train:1".into()),
                ..Default::default()
            }],
            tolerations: Some(vec![k8s_openapi::api::core::v1::Toleration {
                operator: Some("Exists".into()),
                ..Default::default()
            }]),
            ..Default::default()
        }),
        ..Default::default()
    };
    Api::<Pod>::namespaced(client.clone(), namespace)
        .create(&PostParams::default(), &pod)
        .await?;
    Ok(())
}

/// One scenario's figures.
#[derive(Clone, Debug, Default)]
pub struct Row {
    pub scenario: String,
    pub trials: usize,
    pub faults: usize,
    pub violations: Vec<Violation>,
    /// Sick nodes that ended `Healthy` as expected, out of how many should.
    pub healthy: (usize, usize),
    /// Sick nodes that ended `Failed` as expected, out of how many should.
    pub failed: (usize, usize),
    /// Other figures of the scenario, printed under the table.
    pub notes: Vec<String>,
}

impl Row {
    pub fn new(scenario: &str) -> Row {
        Row {
            scenario: scenario.into(),
            ..Default::default()
        }
    }

    /// Adds one trial's faults and what [`crate::invariants::check`] found,
    /// and says so as it goes.
    pub fn add_trial(&mut self, expect: &Expectations, violations: Vec<Violation>) {
        self.trials += 1;
        eprintln!(
            "chaos: {} trial {}: {} sick, {} violations {violations:?}",
            self.scenario,
            self.trials,
            expect.sick.len(),
            violations.len()
        );
        self.faults += expect.sick.len();
        for (node, ending) in &expect.sick {
            let entry = if *ending == Phase::Healthy {
                &mut self.healthy
            } else {
                &mut self.failed
            };
            entry.1 += 1;
            let unsettled = violations
                .iter()
                .any(|v| matches!(v, Violation::NotSettled { node: n, .. } if n == node));
            if !unsettled {
                entry.0 += 1;
            }
        }
        self.violations.extend(violations);
    }
}

/// The table `make chaos` prints, in Markdown.
pub fn table(rows: &[Row]) -> String {
    let mut out = String::from(
        "| scenario | trials | faults injected | invariant violations | ended Healthy as expected | ended Failed as expected |\n|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let ended = |(ok, of): (usize, usize)| {
            if of == 0 {
                "-".to_owned()
            } else {
                format!("{ok}/{of}")
            }
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            r.scenario,
            r.trials,
            r.faults,
            r.violations.len(),
            ended(r.healthy),
            ended(r.failed),
        );
    }
    for r in rows {
        for note in &r.notes {
            let _ = write!(out, "\n- {}: {note}", r.scenario);
        }
    }
    out
}
