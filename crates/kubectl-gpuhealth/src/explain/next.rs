//! "What to do next", derived from the node's state: someone reading a
//! node's story wants the command to run, not the state machine.

use gpuhealth_api::{
    node_health::{Finding, Phase},
    vocabulary::{FindingKind, FindingSubject, Reason},
};
use k8s_openapi::jiff::Timestamp;

use super::{ExplainInput, gangs};
use crate::output::{ago, rfc3339};

pub fn steps(input: &ExplainInput, now: Timestamp) -> Vec<String> {
    let s = &input.status;
    let node = &input.node;
    let reason = s.reason.map_or("-", Reason::as_str);
    let message = s.message.as_deref().unwrap_or("");
    let policy = s.policy.as_deref().unwrap_or("(none)");
    let mut steps = Vec::new();

    match s.phase {
        Phase::Healthy => {}
        Phase::Failed if s.reason == Some(Reason::NodeDeleted) => {
            steps.push(format!("{node}'s Node was deleted mid-incident: {message}"));
            steps.push(format!(
                "find who deleted it (a delete of nodes/{node} in the API server's audit log); if no machine comes back under this name, `kubectl delete gnh {node}`"
            ));
        }
        Phase::Failed if s.quarantine.as_ref().is_some_and(|q| q.per_gpu()) => {
            steps.push(format!(
                "{node} is Failed ({reason}); its bad GPUs stay fenced, the node serving, until a person acts: {message}"
            ));
            steps.push(
                "once the GPUs are repaired and report healthy, gpuhealth lifts their fence and marks the node Healthy".into(),
            );
        }
        Phase::Failed => {
            steps.push(format!(
                "{node} is Failed ({reason}) and stays cordoned until a person acts: {message}"
            ));
            if s.reason != Some(Reason::ReplacementRequested) {
                steps.push(format!(
                    "once it is repaired and its GPUs report healthy, `kubectl uncordon {node}`: gpuhealth then marks it Healthy"
                ));
            }
        }
        Phase::Suspect => steps.push(match s.reason {
            Some(Reason::SignalPending) => {
                format!("wait: {message}; gpuhealth acts if it holds")
            }
            Some(Reason::Paused) => format!(
                "policy {policy} is Paused, so gpuhealth does nothing: {message}; set its spec.mode to Enforce to let it act"
            ),
            Some(Reason::DryRun) => format!(
                "policy {policy} is in DryRun, so gpuhealth changes nothing: {message}; `kubectl get gnh {node} -o yaml` shows the plan (status.plan); set spec.mode to Enforce to act"
            ),
            _ => format!(
                "gpuhealth is holding back ({reason}): {message}; `kubectl gpuhealth status` shows which other nodes are unhealthy or being remediated"
            ),
        }),
        Phase::Verifying if s.reason == Some(Reason::Diagnosing) => steps.push(format!(
            "wait: {message}; the gpuhealth-executor pod on {node} runs dcgmi and logs it; a failed, timed-out or unanswered diagnostic is a failed attempt, and the next rung follows"
        )),
        phase => steps.push(if s.reason == Some(Reason::WaitingForPod) {
            format!(
                "the drain is waiting: {message}; the pod moves when its disruption tolerance and PodDisruptionBudget allow, or the drain times out"
            )
        } else {
            format!("nothing to do yet: gpuhealth is working on it ({phase:?}, {reason}: {message})")
        }),
    }

    steps.extend(gangs::waits(s, node, now));

    let mut current: Vec<&Finding> = s.open_findings().collect();
    // The most specific advice about a workload first: a probe too short
    // says more than "not serving".
    current.sort_by_key(|f| f.type_ != FindingKind::StartupProbeTooShort);

    let mut workloads: Vec<String> = Vec::new();
    for f in &current {
        match f.type_ {
            FindingKind::StartupProbeTooShort => {
                let Some(FindingSubject::Workload(w)) = &f.subject else {
                    steps.push(format!("{}: {}", f.type_, f.message));
                    continue;
                };
                if workloads.iter().any(|seen| seen == w) {
                    continue;
                }
                workloads.push(w.to_owned());
                steps.push(match probe_check_command(w) {
                    Some(cmd) => format!(
                        "{w}: its startup probe gives up before it has started; `{cmd}` prints the startupProbe timing to paste into its spec"
                    ),
                    None => format!(
                        "{w}: its startup probe gives up before it has started: {}",
                        f.message
                    ),
                });
            }
            FindingKind::WorkloadNotRecovered => {
                let id = match &f.subject {
                    Some(FindingSubject::Incident(id)) => Some(id.as_str()),
                    _ => None,
                };
                let evicted = s
                    .history
                    .iter()
                    .find(|i| Some(i.id.as_str()) == id)
                    .and_then(|i| i.workloads.as_ref())
                    .map(|w| w.evicted.clone())
                    .unwrap_or_default();
                for w in evicted {
                    if workloads.contains(&w) {
                        continue;
                    }
                    steps.push(match probe_check_command(&w) {
                        Some(cmd) => format!(
                            "{w} is not serving again after incident {}: `{cmd}` tells a startup probe too short for its cold start from a crash",
                            id.unwrap_or("-")
                        ),
                        None => format!(
                            "{w} is not serving again after incident {}: look at its pods (kubectl describe pod, kubectl logs --previous)",
                            id.unwrap_or("-")
                        ),
                    });
                    workloads.push(w);
                }
            }
            FindingKind::MalformedGpuReport => steps.push(format!(
                "the gpuhealth.io/gpus report on {node} is refused, so gpuhealth is blind to its GPUs: {}; fix its writer (gpuhealth-agent's logs on the node)",
                f.message
            )),
            // A pod on a bad GPU is what the remediation answers; it needs a
            // person only while gpuhealth does not act.
            FindingKind::PodOnBadGpu if s.phase == Phase::Suspect && s.bad_gpus > 0 => {
                steps.push(format!("{}; it stays there until gpuhealth acts", f.message));
            }
            FindingKind::PodOnBadGpu => {}
            // Said with the phase it left the node in.
            FindingKind::NodeDeleted => {}
            FindingKind::NodeQuarantinedInstead => steps.push(format!(
                "{}; to fence a GPU alone, the cluster needs DeviceTaintRules (Kubernetes 1.37, or 1.36 with the DRADeviceTaintRules feature gate and resource.k8s.io/v1beta2 on) and a DRA driver publishing the GPUs, or a device plugin that withdraws exactly the bad GPUs",
                f.message
            )),
            // Each says in its message what to do about it.
            other @ (FindingKind::StaleReport
            | FindingKind::GpusUnreadable
            | FindingKind::NoReport
            | FindingKind::RungUnavailable
            | FindingKind::MalformedMaintenanceNotice
            | FindingKind::MaintenanceDeadlinePassed
            | FindingKind::MaintenanceOverdue
            | FindingKind::BreakGlass
            | FindingKind::UncorroboratedXid
            | FindingKind::AppFaultLoop
            | FindingKind::ForgedRecord) => {
                let subject = f
                    .subject
                    .as_ref()
                    .map(|s| format!(" {s}"))
                    .unwrap_or_default();
                steps.push(format!("{other}{subject}: {}", f.message));
            }
        }
    }

    if let Some(i) = s.history.first()
        && let Some(w) = &i.workloads
        && let (Some(deadline), None) = (&w.deadline, &w.outcome)
        && deadline.0 > now
    {
        steps.push(format!(
            "wait: the workloads incident {} evicted ({}) have until {} ({}) to be Ready again",
            i.id,
            w.evicted.join(", "),
            rfc3339(deadline.0),
            ago(now, deadline.0)
        ));
    }

    if s.phase == Phase::Healthy {
        if steps.is_empty() {
            steps.push(format!(
                "nothing to do: {node} is Healthy and nothing is open"
            ));
        } else {
            steps.insert(
                0,
                format!("{node} itself is Healthy: nothing to do for its GPUs"),
            );
        }
    }
    steps
}

/// The probe-check for a workload named `Kind/namespace/name`, if the
/// plugin can find its pods: a ReplicaSet is named after its Deployment
/// plus the pod template hash, and the Deployment is what its owner edits.
pub fn probe_check_command(workload: &str) -> Option<String> {
    let mut parts = workload.splitn(3, '/');
    let (kind, namespace, name) = (parts.next()?, parts.next()?, parts.next()?);
    let target = match kind {
        "Deployment" => format!("deploy/{name}"),
        "ReplicaSet" => match deployment_of(name) {
            Some(d) => format!("deploy/{d}"),
            None => format!("rs/{name}"),
        },
        "StatefulSet" => format!("sts/{name}"),
        _ => return None,
    };
    Some(format!(
        "kubectl gpuhealth probe-check -n {namespace} {target}"
    ))
}

/// The Deployment a ReplicaSet name comes from, when it ends in a pod
/// template hash (the alphabet Kubernetes draws those from has no vowels).
fn deployment_of(replica_set: &str) -> Option<&str> {
    const HASH: &str = "bcdfghjklmnpqrstvwxz2456789";
    let (deployment, hash) = replica_set.rsplit_once('-')?;
    let is_hash = !hash.is_empty() && hash.len() <= 10 && hash.chars().all(|c| HASH.contains(c));
    (is_hash && !deployment.is_empty()).then_some(deployment)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workload_maps_to_the_probe_check_its_owner_runs() {
        assert_eq!(
            probe_check_command("ReplicaSet/ml-serving/vllm-7d9f6").as_deref(),
            Some("kubectl gpuhealth probe-check -n ml-serving deploy/vllm")
        );
        assert_eq!(
            probe_check_command("ReplicaSet/ml/standalone").as_deref(),
            Some("kubectl gpuhealth probe-check -n ml rs/standalone"),
            "no hash: the ReplicaSet itself"
        );
        assert_eq!(
            probe_check_command("StatefulSet/ml/trainer").as_deref(),
            Some("kubectl gpuhealth probe-check -n ml sts/trainer")
        );
        assert_eq!(probe_check_command("Job/ml/bench"), None);
        assert_eq!(probe_check_command("nonsense"), None);
    }
}
