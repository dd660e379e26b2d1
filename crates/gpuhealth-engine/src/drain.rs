//! The drain planner: which pods on a node leave, which may finish, which
//! block the node, and which are left alone.

use std::collections::BTreeMap;

use gpuhealth_api::{
    contract::{ContractError, DisruptionTolerance},
    gang::GangKey,
    policy::{Drain, DrainScope},
    vocabulary::PodKey,
};
use k8s_openapi::jiff::Timestamp;
use kube_core::{Selector, SelectorExt};

/// A pod as the planner sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct PodView {
    pub namespace: String,
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// Owned by a DaemonSet: it would come straight back; left alone.
    pub daemon: bool,
    /// A static pod mirrored by the kubelet: cannot be evicted; left alone.
    pub mirror: bool,
    /// Has a deletion timestamp: on its way out.
    pub terminating: bool,
    /// Succeeded or Failed: holds nothing.
    pub finished: bool,
    pub requests_gpu: bool,
    /// UUIDs of the GPUs it holds, from the node's GPU report.
    pub gpus: Vec<String>,
    pub tolerance: Result<DisruptionTolerance, ContractError>,
    /// Its controller, as `Kind/namespace/name`: what must come back after
    /// an eviction.
    pub workload: Option<String>,
    /// Its `gpuhealth.io/gpu-healthy` readiness gate.
    pub gpu_gate: GpuGate,
    /// The gang it runs as one of, if any.
    pub gang: Option<GangKey>,
    /// Its `gpuhealth.io/evict-at` annotation: when it was told it leaves
    /// with its gang (unreadable: not told).
    pub evict_at: Option<Timestamp>,
}

/// A pod's `gpuhealth.io/gpu-healthy` readiness gate: pods that list it in
/// `spec.readinessGates` are Ready only while the condition is `True`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GpuGate {
    /// The pod does not list the gate.
    #[default]
    NotOptedIn,
    /// Listed, with no condition yet: the pod is not Ready until it is set.
    Unset,
    /// Listed, with the condition's status.
    Is(bool),
}

impl PodView {
    pub fn key(&self) -> PodKey {
        PodKey::new(&self.namespace, &self.name)
    }
}

/// A PodDisruptionBudget as it stands now, with the pods on this node it covers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BudgetView {
    /// `namespace/name`.
    pub name: String,
    /// `status.disruptionsAllowed`.
    pub allowed: i32,
    /// The pods on the node it covers.
    pub pods: Vec<PodKey>,
}

impl BudgetView {
    /// How the budget stands against the pods a plan would evict, if it
    /// covers any of them.
    pub fn against(&self, evict: &[PodKey]) -> Option<String> {
        let covered: Vec<&PodKey> = evict.iter().filter(|p| self.pods.contains(p)).collect();
        let first = covered.first()?;
        let allowed = usize::try_from(self.allowed).unwrap_or(0);
        let verdict = if allowed == 0 {
            "each eviction would be refused (429) and retried until it allows one"
        } else if allowed >= covered.len() {
            "all could go now"
        } else {
            "the rest would wait their turn"
        };
        let pods = match covered.len() {
            1 => format!("pod {first}"),
            n => format!("{n} pods ({first}, …)"),
        };
        Some(format!(
            "{}: allows {} disruption(s) now for {pods} to evict; {verdict}",
            self.name, self.allowed
        ))
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct DrainPlan {
    /// Evict these now (through the Eviction API).
    pub evict: Vec<PodKey>,
    /// Wait for these: terminating, or tolerance `wait` and still running.
    pub waiting: Vec<PodKey>,
    /// These hold the node back until they go away, with why.
    pub blocked: Vec<(PodKey, String)>,
    /// Why the drain takes more than the GPUs' holders, when it does.
    pub widened: Option<String>,
    /// Members of gangs that leave whole: they go with their gang, by the
    /// gang's round, never one by one (nor forced alone at the timeout).
    pub with_gang: Vec<PodKey>,
    /// Where each gang stands, in words.
    pub gangs: Vec<String>,
    /// Budgets that hold a gang back, in words.
    pub gang_budgets: Vec<String>,
}

impl DrainPlan {
    /// Nothing left in scope: the action may proceed.
    pub fn is_done(&self) -> bool {
        self.evict.is_empty()
            && self.waiting.is_empty()
            && self.blocked.is_empty()
            && self.with_gang.is_empty()
    }

    /// Leaves the pod named `name` out of the plan, whatever it holds.
    pub fn pass_over(&mut self, name: &str) {
        self.evict.retain(|p| p.name != name);
        self.waiting.retain(|p| p.name != name);
        self.blocked.retain(|(p, _)| p.name != name);
        self.with_gang.retain(|p| p.name != name);
    }
}

/// Why a drain may never evict `pod`, if it may not: the policy's
/// exclusions, the cluster's `never` namespaces, or its tolerance.
pub fn never_evicted(drain: &Drain, never: &[String], pod: &PodView) -> Option<String> {
    if excluded(drain, never, pod) {
        return Some("the drain excludes it (the policy's excludeNamespaces or excludePodSelector, or a namespace the cluster never drains)".into());
    }
    match &pod.tolerance {
        Ok(DisruptionTolerance::Never) => Some("its disruption tolerance is `never`".into()),
        Err(e) => Some(format!("unreadable disruption tolerance: {e}")),
        Ok(_) => None,
    }
}

/// Whether the policy or the cluster leaves `pod` alone, whatever it holds.
fn excluded(drain: &Drain, never: &[String], pod: &PodView) -> bool {
    // The API server validated the selector; one that still fails to parse
    // excludes nothing rather than everything.
    let selector = || {
        drain
            .exclude_pod_selector
            .clone()
            .and_then(|s| Selector::try_from(s).ok())
    };
    drain.exclude_namespaces.contains(&pod.namespace)
        || never.contains(&pod.namespace)
        || selector().is_some_and(|s| s.matches(&pod.labels))
}

/// Plans a drain of `pods` for an action on `bad_gpus` (empty: the whole node).
/// Pods in `never` (the cluster's guardrail) are left as the policy's
/// excluded pods are.
pub fn plan(
    drain: &Drain,
    never: &[String],
    scope: DrainScope,
    bad_gpus: &[String],
    pods: &[PodView],
) -> DrainPlan {
    let mut plan = DrainPlan::default();
    for pod in pods {
        if pod.daemon || pod.mirror || pod.finished {
            continue;
        }
        let in_scope = match scope {
            DrainScope::AffectedPods if bad_gpus.is_empty() => pod.requests_gpu,
            DrainScope::AffectedPods => pod.gpus.iter().any(|g| bad_gpus.contains(g)),
            DrainScope::GpuPods => pod.requests_gpu,
            DrainScope::AllPods => true,
        };
        if !in_scope {
            continue;
        }
        if excluded(drain, never, pod) {
            // Never evicted; but a reset or reboot under a pod holding a
            // GPU it acts on would take the GPU from it mid-use: such a
            // pod holds the step back, as a `never` pod does.
            let holds = match bad_gpus {
                [] => !pod.gpus.is_empty() || pod.requests_gpu,
                bad => pod.gpus.iter().any(|g| bad.contains(g)),
            };
            if holds && !pod.terminating {
                plan.blocked.push((
                    pod.key(),
                    "the drain excludes it (the policy's excludeNamespaces or excludePodSelector, or a namespace the cluster never drains) and it holds a GPU the step acts on".into(),
                ));
            }
            continue;
        }
        if pod.terminating {
            plan.waiting.push(pod.key());
            continue;
        }
        match &pod.tolerance {
            Ok(DisruptionTolerance::Evict) => plan.evict.push(pod.key()),
            Ok(DisruptionTolerance::Wait) => plan.waiting.push(pod.key()),
            Ok(DisruptionTolerance::Never) => {
                plan.blocked
                    .push((pod.key(), "its disruption tolerance is `never`".into()));
            }
            // Bad input never triggers an action: treat it as `never`.
            Err(e) => plan
                .blocked
                .push((pod.key(), format!("unreadable disruption tolerance: {e}"))),
        }
    }
    plan
}

#[cfg(test)]
mod tests {
    use gpuhealth_api::policy::GpuHealthPolicySpec;

    use super::*;

    fn pod(name: &str, gpus: &[&str]) -> PodView {
        PodView {
            namespace: "ml".into(),
            name: name.into(),
            labels: BTreeMap::new(),
            daemon: false,
            mirror: false,
            terminating: false,
            finished: false,
            requests_gpu: !gpus.is_empty(),
            gpus: gpus.iter().map(|g| g.to_string()).collect(),
            tolerance: Ok(DisruptionTolerance::Evict),
            workload: None,
            gpu_gate: GpuGate::NotOptedIn,
            gang: None,
            evict_at: None,
        }
    }

    fn drain() -> Drain {
        GpuHealthPolicySpec::for_selector(Default::default()).drain
    }

    #[test]
    fn affected_pods_only_for_a_single_gpu() {
        let pods = [
            pod("vllm-0", &["GPU-7"]),
            pod("vllm-1", &["GPU-1"]),
            pod("web", &[]),
        ];
        let p = plan(
            &drain(),
            &[],
            DrainScope::AffectedPods,
            &["GPU-7".into()],
            &pods,
        );
        assert_eq!(p.evict, ["ml/vllm-0"]);
        let all = plan(&drain(), &[], DrainScope::AllPods, &["GPU-7".into()], &pods);
        assert_eq!(all.evict.len(), 3);
        let gpu = plan(&drain(), &[], DrainScope::GpuPods, &["GPU-7".into()], &pods);
        assert_eq!(gpu.evict, ["ml/vllm-0", "ml/vllm-1"]);
    }

    #[test]
    fn daemonsets_mirrors_and_finished_pods_are_left_alone() {
        let mut ds = pod("exporter", &[]);
        ds.daemon = true;
        let mut mirror = pod("static", &[]);
        mirror.mirror = true;
        let mut done = pod("job", &[]);
        done.finished = true;
        let p = plan(&drain(), &[], DrainScope::AllPods, &[], &[ds, mirror, done]);
        assert!(p.is_done(), "{p:?}");
    }

    #[test]
    fn tolerances() {
        let mut never = pod("trainer", &["GPU-7"]);
        never.tolerance = Ok(DisruptionTolerance::Never);
        let mut wait = pod("batch", &["GPU-7"]);
        wait.tolerance = Ok(DisruptionTolerance::Wait);
        let mut bad = pod("odd", &["GPU-7"]);
        bad.tolerance = "sometimes".parse::<DisruptionTolerance>();
        let mut leaving = pod("leaving", &["GPU-7"]);
        leaving.terminating = true;
        let p = plan(
            &drain(),
            &[],
            DrainScope::AffectedPods,
            &["GPU-7".into()],
            &[never, wait, bad, leaving],
        );
        assert!(p.evict.is_empty());
        assert_eq!(p.waiting, ["ml/batch", "ml/leaving"]);
        assert_eq!(
            p.blocked.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            ["ml/trainer", "ml/odd"]
        );
        assert!(p.blocked[0].1.contains("never"));
    }

    #[test]
    fn exclusions_are_never_touched() {
        let mut d = drain();
        d.exclude_namespaces = vec!["kube-system".into()];
        d.exclude_pod_selector = Some(
            k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector {
                match_labels: Some([("keep".to_owned(), "yes".to_owned())].into()),
                ..Default::default()
            },
        );
        let mut sys = pod("coredns", &[]);
        sys.namespace = "kube-system".into();
        let mut kept = pod("kept", &[]);
        kept.labels.insert("keep".into(), "yes".into());
        let p = plan(
            &d,
            &[],
            DrainScope::AllPods,
            &[],
            &[sys, kept, pod("other", &[])],
        );
        assert_eq!(p.evict, ["ml/other"]);
        assert!(p.blocked.is_empty());
    }

    #[test]
    fn a_namespace_the_cluster_never_drains_is_left_whatever_the_policy_says() {
        // AllPods, and no exclusion of the policy's own.
        let mut sys = pod("coredns", &[]);
        sys.namespace = "kube-system".into();
        let p = plan(
            &drain(),
            &["kube-system".into()],
            DrainScope::AllPods,
            &[],
            &[sys, pod("other", &[])],
        );
        assert_eq!(p.evict, ["ml/other"]);
    }

    #[test]
    fn an_excluded_pod_on_a_gpu_the_step_acts_on_holds_it_back_untouched() {
        let mut d = drain();
        d.exclude_namespaces = vec!["infra".into()];
        let mut on_bad = pod("exporter", &["GPU-7"]);
        on_bad.namespace = "infra".into();
        let mut on_good = pod("other-exporter", &["GPU-1"]);
        on_good.namespace = "infra".into();
        let pods = [on_bad, on_good, pod("vllm-7", &["GPU-7"])];
        let reset = plan(&d, &[], DrainScope::AffectedPods, &["GPU-7".into()], &pods);
        assert_eq!(reset.evict, ["ml/vllm-7"]);
        assert_eq!(
            reset.blocked.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            ["infra/exporter"],
            "never evicted, never passed over"
        );
        assert!(reset.blocked[0].1.contains("excludeNamespaces"));
        // A reboot acts on every GPU.
        let reboot = plan(&d, &[], DrainScope::AffectedPods, &[], &pods);
        assert_eq!(
            reboot.blocked.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            ["infra/exporter", "infra/other-exporter"]
        );
    }

    #[test]
    fn a_signal_without_a_gpu_drains_every_gpu_pod() {
        let pods = [
            pod("vllm-0", &["GPU-7"]),
            pod("vllm-1", &["GPU-1"]),
            pod("web", &[]),
        ];
        let p = plan(&drain(), &[], DrainScope::AffectedPods, &[], &pods);
        assert_eq!(p.evict, ["ml/vllm-0", "ml/vllm-1"]);
    }
}
