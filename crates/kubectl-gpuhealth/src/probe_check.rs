//! `kubectl gpuhealth probe-check TARGET`: does a workload's startup window
//! cover its cold start? The engine judges (`gpuhealth_engine::workload`);
//! this module picks the pods, shows the arithmetic and what each pod
//! showed, and prints the `startupProbe` timing to paste when the window is
//! too short. The verdict is information, so a check that ran exits 0.

use gpuhealth_api::contract::XidEvent;
use gpuhealth_engine::{
    probes::{ColdStart, MARGIN_PERCENT, ProbeTiming, StartBound, Verdict},
    restarts::RestartCause,
    workload::{PodObservation, assess, cause_text, observe, verdict_text},
};
use k8s_openapi::{
    api::core::v1::{Event, Pod},
    apimachinery::pkg::apis::meta::v1::LabelSelector,
};
use kube::core::Selector;
use serde::Serialize;

use crate::output::{Paint, Style};

/// What to check, as `kubectl` names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    Pod(String),
    Deployment(String),
    StatefulSet(String),
    ReplicaSet(String),
}

impl Target {
    /// `POD`, `pod/NAME`, `deploy/NAME`, `sts/NAME`, `rs/NAME`, with
    /// kubectl's long and plural spellings.
    pub fn parse(s: &str) -> Result<Target, String> {
        let Some((kind, name)) = s.split_once('/') else {
            return non_empty(s).map(|n| Target::Pod(n.to_owned()));
        };
        let name = non_empty(name)?.to_owned();
        match kind.to_ascii_lowercase().as_str() {
            "po" | "pod" | "pods" => Ok(Target::Pod(name)),
            "deploy" | "deployment" | "deployments" => Ok(Target::Deployment(name)),
            "sts" | "statefulset" | "statefulsets" => Ok(Target::StatefulSet(name)),
            "rs" | "replicaset" | "replicasets" => Ok(Target::ReplicaSet(name)),
            other => Err(format!(
                "cannot check a {other:?}: name a pod (POD or pod/NAME), a Deployment (deploy/NAME), a StatefulSet (sts/NAME) or a ReplicaSet (rs/NAME)"
            )),
        }
    }
}

fn non_empty(name: &str) -> Result<&str, String> {
    let name = name.trim();
    if name.is_empty() || name.contains('/') {
        Err(format!("{name:?} is not a name"))
    } else {
        Ok(name)
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Target::Pod(n) => write!(f, "pod/{n}"),
            Target::Deployment(n) => write!(f, "deploy/{n}"),
            Target::StatefulSet(n) => write!(f, "sts/{n}"),
            Target::ReplicaSet(n) => write!(f, "rs/{n}"),
        }
    }
}

/// A controller's selector as a label query. An empty selector would match
/// every pod of the namespace, which is never what a check means.
pub fn label_query(what: &str, selector: Option<&LabelSelector>) -> Result<String, String> {
    let selector = selector.ok_or_else(|| format!("{what} has no selector"))?;
    let parsed = Selector::try_from(selector.clone())
        .map_err(|e| format!("{what} has a selector this tool cannot read: {e}"))?;
    if parsed.selects_all() {
        return Err(format!(
            "{what} has an empty selector: it would match every pod"
        ));
    }
    Ok(parsed.to_string())
}

/// The pods that share `pod`'s controller (itself included), so that the
/// verdict uses every observation of the workload; just `pod` without one.
pub fn siblings(pod: &Pod, all: Vec<Pod>) -> Vec<Pod> {
    let controller = pod
        .metadata
        .owner_references
        .as_ref()
        .and_then(|os| os.iter().find(|o| o.controller == Some(true)))
        .map(|o| o.uid.clone());
    let Some(uid) = controller else {
        return vec![pod.clone()];
    };
    let mut pods: Vec<Pod> = all
        .into_iter()
        .filter(|p| {
            p.metadata.owner_references.as_ref().is_some_and(|os| {
                os.iter()
                    .any(|o| o.controller == Some(true) && o.uid == uid)
            })
        })
        .collect();
    if !pods.iter().any(|p| p.metadata.uid == pod.metadata.uid) {
        pods.push(pod.clone());
    }
    pods
}

/// One pod and what the cluster says about it.
#[derive(Clone, Debug)]
pub struct PodInput {
    pub pod: Pod,
    /// Events about pods of this name; those about an earlier pod of the
    /// same name are dropped by uid.
    pub events: Vec<Event>,
    pub xids: Vec<XidEvent>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Check {
    pub target: String,
    pub namespace: String,
    pub pods: Vec<PodLine>,
    pub ready: usize,
    pub containers: Vec<ContainerCheck>,
    pub restarts: Vec<RestartLine>,
    /// Why the workload is not serving; empty when it is.
    pub not_serving: String,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodLine {
    pub name: String,
    pub phase: String,
    pub ready: bool,
    pub node: Option<String>,
    /// Why containers wait (`CrashLoopBackOff`, `ContainerCreating`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub waiting: Vec<String>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum ProbeKind {
    Startup,
    Liveness,
    None,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Timing {
    pub initial_delay_seconds: u32,
    pub period_seconds: u32,
    pub timeout_seconds: u32,
    pub failure_threshold: u32,
    pub window_seconds: u64,
}

impl From<ProbeTiming> for Timing {
    fn from(p: ProbeTiming) -> Self {
        Timing {
            initial_delay_seconds: p.initial_delay_seconds,
            period_seconds: p.period_seconds,
            timeout_seconds: p.timeout_seconds,
            failure_threshold: p.failure_threshold,
            window_seconds: p.window().as_secs(),
        }
    }
}

/// Named as the engine's `Verdict` is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum VerdictKind {
    Ok,
    WindowTooShort,
    Unknown,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ContainerCheck {
    pub container: String,
    /// The probe that can kill it while it starts.
    pub probe: ProbeKind,
    pub timing: Option<Timing>,
    pub window_seconds: Option<u64>,
    pub observed: Vec<Observed>,
    pub verdict: VerdictKind,
    /// The verdict in words, with the fix when there is one.
    pub verdict_text: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub needs_at_least_seconds: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub recommended: Option<Timing>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub missing: Option<String>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Observed {
    pub pod: String,
    /// `ready`: started and became Ready; `killedAfter`: killed by its
    /// probe this long after starting, never Ready; `beforeProbe`: Ready
    /// sooner than the startup probe's `initialDelaySeconds`, which no
    /// kubelet allows, so not taken as a cold start.
    pub kind: &'static str,
    pub seconds: u64,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct RestartLine {
    pub pod: String,
    pub container: String,
    pub count: u32,
    pub cause: String,
    pub text: String,
}

/// The check of `target` from its pods.
pub fn check(target: &str, namespace: &str, pods: &[PodInput]) -> Check {
    // Newest first: the engine takes each container's probe from the first
    // pod that has it, and mid-rollout the newest template is the one that
    // matters.
    let mut pods: Vec<&PodInput> = pods.iter().collect();
    pods.sort_by_key(|p| {
        std::cmp::Reverse(p.pod.metadata.creation_timestamp.as_ref().map(|t| t.0))
    });
    let observations: Vec<PodObservation> = pods
        .iter()
        .map(|p| {
            let uid = p.pod.metadata.uid.as_deref();
            let events: Vec<Event> = p
                .events
                .iter()
                .filter(|e| {
                    e.involved_object.uid.is_none() || e.involved_object.uid.as_deref() == uid
                })
                .cloned()
                .collect();
            observe(&p.pod, &events, p.xids.clone())
        })
        .collect();
    let a = assess(&observations);

    let containers = a
        .containers
        .iter()
        .map(|c| {
            let observed = observations
                .iter()
                .flat_map(|p| {
                    p.containers
                        .iter()
                        .filter(|pc| pc.name == c.container)
                        .flat_map(|pc| p.cold_starts(pc))
                        .map(|cs| match cs {
                            ColdStart::Ready(d) => Observed {
                                pod: p.pod.to_string(),
                                kind: "ready",
                                seconds: d.as_secs(),
                            },
                            ColdStart::KilledAfter(d) => Observed {
                                pod: p.pod.to_string(),
                                kind: "killedAfter",
                                seconds: d.as_secs(),
                            },
                            ColdStart::BeforeProbe(d) => Observed {
                                pod: p.pod.to_string(),
                                kind: "beforeProbe",
                                seconds: d.as_secs(),
                            },
                        })
                        .collect::<Vec<_>>()
                })
                .collect();
            let (verdict, needs, recommended, missing) = match &c.verdict {
                Verdict::Ok { .. } => (VerdictKind::Ok, None, None, None),
                Verdict::WindowTooShort {
                    needs_at_least,
                    recommended,
                    ..
                } => (
                    VerdictKind::WindowTooShort,
                    Some(needs_at_least.as_secs()),
                    Some(Timing::from(*recommended)),
                    None,
                ),
                Verdict::Unknown { missing } => {
                    (VerdictKind::Unknown, None, None, Some(missing.clone()))
                }
            };
            ContainerCheck {
                container: c.container.clone(),
                probe: match c.bound {
                    StartBound::Startup(_) => ProbeKind::Startup,
                    StartBound::Liveness(_) => ProbeKind::Liveness,
                    StartBound::Unbounded => ProbeKind::None,
                },
                timing: c.bound.probe().map(Timing::from),
                window_seconds: c.bound.window().map(|w| w.as_secs()),
                observed,
                verdict,
                verdict_text: verdict_text(&c.container, &c.verdict),
                needs_at_least_seconds: needs,
                recommended,
                missing,
            }
        })
        .collect();

    Check {
        target: target.to_owned(),
        namespace: namespace.to_owned(),
        pods: observations
            .iter()
            .zip(&pods)
            .map(|(o, p)| PodLine {
                name: o.pod.to_string(),
                phase: o.phase.clone(),
                ready: o.ready,
                node: p.pod.spec.as_ref().and_then(|s| s.node_name.clone()),
                waiting: o
                    .containers
                    .iter()
                    .filter_map(|c| c.waiting.as_ref().map(|w| format!("{}: {w}", c.name)))
                    .collect(),
            })
            .collect(),
        ready: a.fine,
        restarts: a
            .restarts
            .iter()
            .map(|r| RestartLine {
                pod: r.pod.to_string(),
                container: r.container.clone(),
                count: r.count,
                cause: cause_name(&r.cause),
                text: cause_text(&r.cause),
            })
            .collect(),
        not_serving: a.why_not(),
        containers,
    }
}

fn cause_name(cause: &RestartCause) -> String {
    match cause {
        RestartCause::GpuError { .. } => "GpuError",
        RestartCause::OomKilled => "OOMKilled",
        RestartCause::StartupProbe => "StartupProbe",
        RestartCause::LivenessProbe => "LivenessProbe",
        RestartCause::ExitedWithError { .. } => "ExitedWithError",
        RestartCause::Completed => "Completed",
    }
    .into()
}

/// The check as a person reads it.
pub fn text(c: &Check, style: Style) -> String {
    let mut out = style.bold(&format!(
        "{} in namespace {}: {} pod(s), {} Ready",
        c.target,
        c.namespace,
        c.pods.len(),
        c.ready
    ));
    out.push('\n');
    for p in &c.pods {
        let ready = if p.ready {
            style.green("Ready")
        } else {
            style.yellow("not Ready")
        };
        let node = p
            .node
            .as_deref()
            .map_or_else(|| ", not scheduled".into(), |n| format!(", on {n}"));
        let waiting = if p.waiting.is_empty() {
            String::new()
        } else {
            format!(", waiting ({})", p.waiting.join(", "))
        };
        out.push_str(&format!(
            "  {} {}, {ready}{node}{waiting}\n",
            p.name, p.phase
        ));
    }
    if c.pods.is_empty() {
        out.push_str(&format!("  {}\n", c.not_serving));
    }

    for k in &c.containers {
        out.push('\n');
        out.push_str(&style.bold(&format!("container {}", k.container)));
        out.push('\n');
        out.push_str(&container_text(k, style));
    }

    if !c.restarts.is_empty() {
        out.push('\n');
        out.push_str(&style.bold("Restarts"));
        out.push('\n');
        for r in &c.restarts {
            out.push_str(&format!(
                "  {} container {}: {} time(s), last {}\n",
                r.pod, r.container, r.count, r.text
            ));
        }
    }
    out
}

fn container_text(k: &ContainerCheck, style: Style) -> String {
    let mut out = String::new();
    let probe = match k.probe {
        ProbeKind::Startup => "startupProbe",
        ProbeKind::Liveness => "livenessProbe (no startupProbe: liveness runs from the start)",
        ProbeKind::None => {
            "nothing: no startupProbe or livenessProbe, so no probe kills a slow start"
        }
    };
    out.push_str(&format!("  bounded by   {probe}\n"));
    if let Some(t) = &k.timing {
        out.push_str(&format!("  window       {}\n", arithmetic(t)));
    }
    if k.observed.is_empty() {
        out.push_str("  cold starts  none observed\n");
    }
    for (n, o) in k.observed.iter().enumerate() {
        let label = if n == 0 { "cold starts" } else { "" };
        let what = match o.kind {
            "ready" => format!("Ready {}s after it started", o.seconds),
            "beforeProbe" => format!(
                "Ready {}s after it started, before its startup probe could run: not taken as a cold start",
                o.seconds
            ),
            _ => format!(
                "killed by its probe {}s after it started, never Ready (the kubelet's Killing Event)",
                o.seconds
            ),
        };
        out.push_str(&format!("  {label:<11}  {}: {what}\n", o.pod));
    }
    let words = k
        .verdict_text
        .strip_prefix(&format!("container {}: ", k.container))
        .unwrap_or(&k.verdict_text);
    let (kind, paint) = match k.verdict {
        VerdictKind::Ok => ("Ok", Paint::Green),
        VerdictKind::WindowTooShort => ("WindowTooShort", Paint::Red),
        VerdictKind::Unknown => ("Unknown", Paint::Yellow),
    };
    out.push_str(&format!(
        "  verdict      {}: {words}\n",
        style.apply(paint, kind)
    ));
    if let Some(missing) = &k.missing {
        out.push_str(&format!(
            "  missing      {missing}; run this again once a pod has become Ready or been killed by its probe\n"
        ));
    }
    if let (Some(r), Some(needs)) = (&k.recommended, k.needs_at_least_seconds) {
        out.push_str(&snippet(k, r, needs));
    }
    out
}

/// The window's arithmetic, as the kubelet applies it.
pub fn arithmetic(t: &Timing) -> String {
    format!(
        "initialDelaySeconds {} + failureThreshold {} × max(periodSeconds {}, timeoutSeconds {}) = {}s",
        t.initial_delay_seconds,
        t.failure_threshold,
        t.period_seconds,
        t.timeout_seconds,
        t.window_seconds
    )
}

/// The `startupProbe` timing to paste. Only the timing: the handler
/// (`httpGet`, `tcpSocket`, `exec`, `grpc`) is the owner's and stays.
fn snippet(k: &ContainerCheck, r: &Timing, needs: u64) -> String {
    let handler = match k.probe {
        ProbeKind::Liveness => {
            "# new: give it the same handler as the livenessProbe (httpGet, tcpSocket, exec or grpc)"
        }
        _ => {
            "# keep its handler (httpGet, tcpSocket, exec or grpc) as it is; only the timing changes"
        }
    };
    let was = k
        .timing
        .filter(|_| k.probe == ProbeKind::Startup)
        .map(|t| format!("  # was {}", t.failure_threshold))
        .unwrap_or_default();
    format!(
        "\n  Set in the pod template, for a {}s window: the cold start seen (at least {needs}s) plus {MARGIN_PERCENT}%:\n\
         \x20   containers:\n\
         \x20     - name: {}\n\
         \x20       startupProbe:\n\
         \x20         {handler}\n\
         \x20         initialDelaySeconds: {}\n\
         \x20         periodSeconds: {}\n\
         \x20         timeoutSeconds: {}\n\
         \x20         failureThreshold: {}{was}\n",
        r.window_seconds,
        k.container,
        r.initial_delay_seconds,
        r.period_seconds,
        r.timeout_seconds,
        r.failure_threshold,
    )
}

#[cfg(test)]
mod tests;
