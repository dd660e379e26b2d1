//! `kubectl gpuhealth explain NODE`: the node's story from its first signal
//! to now. The signals come from the GPU report on the Node (each Xid with
//! its time and text), the incidents from `GpuNodeHealth.status.history`
//! (durable), the phase log from the Events about the Node (fine-grained,
//! but the API server forgets them after an hour or so), and the findings
//! from the status. Rendering is a pure function of those, so a golden file
//! pins it.
//!
//! Long because each section of the story renders here (what to do next
//! is in `explain/next.rs`, the gangs in `explain/gangs.rs`, the tests in
//! `explain/tests.rs`).

mod gangs;
mod next;

use gpuhealth_api::{
    GpuNodeHealthStatus,
    contract::{DiagnosticsResult, GpuReport},
    node_health::{Finding, Incident, Phase},
    policy::XidOverride,
    quarantine::{Fenced, QuarantineStatus},
    types::SignalAction,
    vocabulary::{Attempt, IncidentOutcome, PodKey, WorkloadOutcome},
};
use gpuhealth_engine::{
    fence::gpu_name,
    xid::{self, XidClass},
};
use k8s_openapi::{
    api::{core::v1::Event as CoreEvent, events::v1::Event as EventsV1Event},
    apimachinery::pkg::apis::meta::v1::Time,
    jiff::Timestamp,
};
use serde::Serialize;

use crate::{
    output::{Paint, Style, ago, duration, offset, rfc3339},
    status::phase_paint,
};

/// The component name gpuhealth's operator reports its Events as.
pub const OPERATOR: &str = "gpuhealth-operator";

/// Everything the story is told from.
#[derive(Clone, Debug)]
pub struct ExplainInput {
    pub node: String,
    pub status: GpuNodeHealthStatus,
    /// The node's GPU report, or why it could not be read.
    pub report: Result<GpuReport, String>,
    /// The Events about the node's name, in any order: those of an earlier
    /// Node object of the same name are left out of the story.
    pub events: Vec<NodeEvent>,
    /// The Node object now: its uid and when it was made, if it was read.
    pub node_object: Option<(String, Option<Timestamp>)>,
    /// The managing policy's Xid overrides, to name each Xid's meaning as
    /// the operator saw it.
    pub xid_overrides: Vec<XidOverride>,
}

/// An Event about the node, whichever API it was read from.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeEvent {
    pub at: Timestamp,
    /// `Normal` or `Warning`.
    pub type_: String,
    pub reason: String,
    pub message: String,
    /// Who wrote it (`gpuhealth-operator`, `kubelet`, ...).
    pub reporter: String,
    pub count: u32,
    /// The uid of the Node it is about, as the Event names it (the kubelet
    /// writes the node's name there).
    pub uid: String,
}

impl NodeEvent {
    /// Whether it is about this Node object, not an earlier one of the same
    /// name: its uid is the node's (or, as the kubelet writes it, the
    /// node's name, or none), and it is not older than the node.
    pub fn is_about(&self, name: &str, uid: &str, created: Option<Timestamp>) -> bool {
        let same_object = self.uid.is_empty() || self.uid == uid || self.uid == name;
        same_object && created.is_none_or(|c| self.at >= c)
    }

    /// From a core/v1 Event. Events written through events.k8s.io/v1 (as
    /// the operator's Recorder does) read the same here: the API server
    /// maps `regarding` to `involvedObject` and `note` to `message`.
    pub fn from_core(e: &CoreEvent) -> Option<NodeEvent> {
        let at = e
            .event_time
            .as_ref()
            .map(|t| t.0)
            .or(e.first_timestamp.as_ref().map(|t| t.0))
            .or(e.last_timestamp.as_ref().map(|t| t.0))
            .or(e.metadata.creation_timestamp.as_ref().map(|t| t.0))?;
        let reporter = e
            .reporting_component
            .clone()
            .filter(|s| !s.is_empty())
            .or_else(|| e.source.as_ref().and_then(|s| s.component.clone()))
            .unwrap_or_default();
        let count = e
            .series
            .as_ref()
            .and_then(|s| s.count)
            .or(e.count)
            .unwrap_or(1);
        Some(NodeEvent {
            at,
            type_: e.type_.clone().unwrap_or_else(|| "Normal".into()),
            reason: e.reason.clone().unwrap_or_default(),
            message: e.message.clone().unwrap_or_default(),
            reporter,
            count: u32::try_from(count).unwrap_or(1).max(1),
            uid: e.involved_object.uid.clone().unwrap_or_default(),
        })
    }

    /// From an events.k8s.io/v1 Event.
    pub fn from_events_v1(e: &EventsV1Event) -> Option<NodeEvent> {
        let at = e
            .event_time
            .as_ref()
            .map(|t| t.0)
            .or(e.deprecated_first_timestamp.as_ref().map(|t| t.0))
            .or(e.deprecated_last_timestamp.as_ref().map(|t| t.0))
            .or(e.metadata.creation_timestamp.as_ref().map(|t| t.0))?;
        let reporter = e
            .reporting_controller
            .clone()
            .filter(|s| !s.is_empty())
            .or_else(|| {
                e.deprecated_source
                    .as_ref()
                    .and_then(|s| s.component.clone())
            })
            .unwrap_or_default();
        let count = e
            .series
            .as_ref()
            .map(|s| s.count)
            .or(e.deprecated_count)
            .unwrap_or(1);
        Some(NodeEvent {
            at,
            type_: e.type_.clone().unwrap_or_else(|| "Normal".into()),
            reason: e.reason.clone().unwrap_or_default(),
            message: e.note.clone().unwrap_or_default(),
            reporter,
            count: u32::try_from(count).unwrap_or(1).max(1),
            uid: e
                .regarding
                .as_ref()
                .and_then(|r| r.uid.clone())
                .unwrap_or_default(),
        })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Kind {
    /// An Xid from the GPU report.
    Signal,
    /// An incident opened or ended (from the status history).
    Incident,
    /// An Event about the node.
    Event,
    /// A finding in the status.
    Finding,
    /// The verdict on the workloads an incident evicted.
    Workloads,
}

/// One line of the story.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Entry {
    pub at: Time,
    /// From the first signal: `+0s`, `+58s`, `-2h5m`.
    pub offset: String,
    pub kind: Kind,
    pub text: String,
    #[serde(skip)]
    paint: Paint,
}

/// The `-o json|yaml` answer: the timeline, the advice, and the status it
/// was told from.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Explanation<'a> {
    pub node: &'a str,
    /// What offsets count from: the first signal, else the first entry.
    pub origin: Option<Time>,
    pub timeline: Vec<Entry>,
    pub next: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub report_error: Option<&'a str>,
    pub status: &'a GpuNodeHealthStatus,
}

pub fn explanation(input: &ExplainInput, now: Timestamp) -> Explanation<'_> {
    let (origin, timeline) = timeline(input);
    Explanation {
        node: &input.node,
        origin: origin.map(Time),
        timeline,
        next: next::steps(input, now),
        report_error: input.report.as_ref().err().map(String::as_str),
        status: &input.status,
    }
}

/// The story's entries in time order, and the instant offsets count from.
pub fn timeline(input: &ExplainInput) -> (Option<Timestamp>, Vec<Entry>) {
    let mut raw: Vec<(Timestamp, Kind, String, Paint)> = Vec::new();

    if let Ok(report) = &input.report {
        for gpu in &report.gpus {
            for x in &gpu.xids {
                raw.push((
                    x.at.0,
                    Kind::Signal,
                    format!(
                        "Xid {} on GPU {} ({}, {}): {} ({})",
                        x.code,
                        gpu.index,
                        gpu.uuid,
                        gpu.pci_bus_id,
                        x.text,
                        xid_meaning(x.code, &x.text, &input.xid_overrides)
                    ),
                    Paint::Red,
                ));
            }
        }
    }
    // The Xids that opened each incident, kept on its record: the report
    // forgets them once the GPU is well again.
    let shown: Vec<(&str, u32, Timestamp)> = match &input.report {
        Ok(report) => report
            .gpus
            .iter()
            .flat_map(|g| g.xids.iter().map(|x| (g.uuid.as_str(), x.code, x.at.0)))
            .collect(),
        Err(_) => Vec::new(),
    };
    for i in &input.status.history {
        for s in &i.signals {
            let Some(x) = &s.xid else { continue };
            let gpu = s.gpu.as_deref().unwrap_or_default();
            if shown.contains(&(gpu, x.code, x.at.0)) {
                continue;
            }
            raw.push((
                x.at.0,
                Kind::Signal,
                format!(
                    "{} ({})",
                    s.message,
                    xid_meaning(x.code, &x.text, &input.xid_overrides)
                ),
                Paint::Red,
            ));
        }
    }
    let first_signal = raw.iter().map(|r| r.0).min();

    // Oldest incident first: history is stored newest first.
    for i in input.status.history.iter().rev() {
        raw.push((
            i.started_at.0,
            Kind::Incident,
            format!("{} opened: {}", i.id, i.trigger),
            Paint::Bold,
        ));
        if let (Some(end), Some(outcome)) = (&i.ended_at, &i.outcome) {
            let tried = tried(i);
            let actions = if tried.is_empty() {
                String::new()
            } else {
                format!(" ({})", tried.join(", "))
            };
            raw.push((
                end.0,
                Kind::Incident,
                format!(
                    "{} ended: {outcome} after {}{actions}",
                    i.id,
                    duration(end.0.duration_since(i.started_at.0))
                ),
                if *outcome == IncidentOutcome::Recovered {
                    Paint::Green
                } else {
                    Paint::Red
                },
            ));
        }
    }

    // A finding is announced by a Warning Event with the same reason and
    // message, and a workload verdict by a finding: tell each once, from
    // the most precise source still there.
    let mut told: Vec<(String, String)> = Vec::new();
    let mut events = input.events.clone();
    if let Some((uid, created)) = &input.node_object {
        events.retain(|e| e.is_about(&input.node, uid, *created));
    }
    events.sort_by_key(|e| e.at);
    for e in &events {
        told.push((e.reason.clone(), e.message.clone()));
        let mut head = e.reason.clone();
        if e.type_ != "Normal" {
            head.push_str(&format!(" ({})", e.type_));
        }
        if !e.reporter.is_empty() && e.reporter != OPERATOR {
            head.push_str(&format!(" [{}]", e.reporter));
        }
        if e.count > 1 {
            head.push_str(&format!(" ×{}", e.count));
        }
        raw.push((
            e.at,
            Kind::Event,
            format!("{head}: {}", e.message),
            if e.type_ == "Normal" {
                Paint::Plain
            } else {
                Paint::Yellow
            },
        ));
    }
    for f in &input.status.findings {
        let key = (f.type_.as_str().to_owned(), f.message.clone());
        if told.contains(&key) {
            continue;
        }
        told.push(key);
        let subject = f
            .subject
            .as_ref()
            .map(|s| format!(" {s}"))
            .unwrap_or_default();
        raw.push((
            f.observed_at.0,
            Kind::Finding,
            format!("{}{subject}: {}", f.type_, f.message),
            Paint::Yellow,
        ));
    }
    for i in &input.status.history {
        let Some(w) = &i.workloads else { continue };
        // Judged at the deadline only when they did not make it; an earlier
        // Recovered has no time of its own but its Event.
        let not_recovered = WorkloadOutcome::WorkloadNotRecovered;
        if let (Some(deadline), Some(outcome)) = (&w.deadline, w.outcome)
            && outcome == not_recovered
        {
            let message = w.message.clone().unwrap_or_default();
            if told.contains(&(not_recovered.as_str().to_owned(), message.clone())) {
                continue;
            }
            raw.push((
                deadline.0,
                Kind::Workloads,
                format!("WorkloadNotRecovered after {}: {message}", i.id),
                Paint::Red,
            ));
        }
    }

    // Stable: at the same instant, signals come before what they caused.
    raw.sort_by_key(|r| r.0);
    let origin = first_signal.or(raw.first().map(|r| r.0));
    let entries = raw
        .into_iter()
        .map(|(at, kind, text, paint)| Entry {
            offset: origin.map_or_else(|| "+0s".into(), |o| offset(o, at)),
            at: Time(at),
            kind,
            text,
            paint,
        })
        .collect();
    (origin, entries)
}

/// What an Xid asks for, in words, by the engine's table and the policy's
/// overrides.
fn xid_meaning(code: u32, text: &str, overrides: &[XidOverride]) -> String {
    match xid::class(code, overrides) {
        XidClass::Needs(action) => format!("asks for {}", action_words(action)),
        XidClass::RecoveryActionChanged => match xid::recovery_action_in_text(text) {
            Some(value) => format!(
                "recovery action {value:#x}: asks for {}",
                action_words(xid::recovery_action(value))
            ),
            None => "recovery action changed, to a value not in the text".into(),
        },
        XidClass::AppFault => format!(
            "an application fault: a GPU reset only if it repeats {} times within an hour",
            xid::APP_FAULT_REPEATS
        ),
        XidClass::Informational => "informational: nothing to do".into(),
        XidClass::Unknown => "not in gpuhealth's Xid table: reported, never acted on".into(),
    }
}

fn action_words(action: SignalAction) -> &'static str {
    match action {
        SignalAction::Ignore => "nothing",
        SignalAction::GpuReset => "a GPU reset",
        SignalAction::NodeReboot => "a node reboot",
        SignalAction::ReplaceNode => "replacing the node",
    }
}

/// The story as a person reads it. `now` only gives the current phase its
/// age and findings theirs.
pub fn render(input: &ExplainInput, now: Timestamp, style: Style) -> String {
    let s = &input.status;
    let (origin, entries) = timeline(input);
    let mut out = String::new();
    let policy = s
        .policy
        .as_deref()
        .map_or_else(|| "no policy".into(), |p| format!("policy {p}"));
    out.push_str(&style.bold(&format!("Node {} ({policy})", input.node)));
    out.push('\n');
    if let Err(e) = &input.report {
        out.push_str(&format!(
            "{}: {e}; the timeline has no Xids\n",
            style.yellow("No GPU report")
        ));
    }

    out.push('\n');
    // Without an Xid (aged out of the report, or a node-condition signal)
    // the offsets count from the first thing recorded.
    let from = if entries.iter().any(|e| e.kind == Kind::Signal) {
        "the first signal"
    } else {
        "the first entry"
    };
    match origin {
        Some(o) => {
            out.push_str(&style.bold(&format!("Timeline (offsets from {from}, {})", rfc3339(o))))
        }
        None => out.push_str(&style.bold("Timeline")),
    }
    out.push('\n');
    if entries.is_empty() {
        out.push_str("  nothing recorded: no Xid, incident, Event or finding\n");
    }
    let offset_width = entries.iter().map(|e| e.offset.len()).max().unwrap_or(0);
    for e in &entries {
        let kind = format!("{:<9}", format!("{:?}", e.kind).to_lowercase());
        out.push_str(&format!(
            "  {}  {:<offset_width$}  {}  {}\n",
            rfc3339(e.at.0),
            e.offset,
            style.apply(e.paint, &kind),
            e.text
        ));
    }

    let at = |t: &Time| match origin {
        Some(o) => format!("{}  {}", rfc3339(t.0), offset(o, t.0)),
        None => rfc3339(t.0),
    };
    for i in s.history.iter().rev() {
        out.push('\n');
        out.push_str(&incident(i, s, now, style, &at));
    }

    out.push('\n');
    out.push_str(&style.bold("Now"));
    out.push('\n');
    let phase = format!("{:?}", s.phase);
    let since = s.phase_since.as_ref().map_or_else(String::new, |t| {
        format!(
            " since {} (for {})",
            rfc3339(t.0),
            duration(now.duration_since(t.0))
        )
    });
    out.push_str(&format!(
        "  phase      {}{since}\n",
        style.apply(phase_paint(s.phase), &phase)
    ));
    if s.phase != Phase::Healthy {
        out.push_str(&format!(
            "  reason     {}: {}\n",
            s.reason.map_or("-", |r| r.as_str()),
            s.message.as_deref().unwrap_or("")
        ));
    }
    if let Some(a) = &s.action {
        let mut line = format!("{:?} attempt {} ({})", a.type_, a.attempt, a.id);
        if let Some(r) = &a.requested_at {
            line.push_str(&format!(", requested {}", rfc3339(r.0)));
        }
        if let Some(d) = &a.deadline {
            line.push_str(&format!(", times out {}", ago(now, d.0)));
        }
        out.push_str(&format!("  action     {line}\n"));
    }
    if let Some(q) = &s.quarantine {
        out.push_str(&format!("  fenced     {}\n", fence_line(q)));
    }
    out.push_str(&format!("  GPUs       {}\n", gpus_line(input)));

    out.push('\n');
    out.push_str(&style.bold("Open findings"));
    out.push('\n');
    let open: Vec<&Finding> = s.open_findings().collect();
    if open.is_empty() {
        out.push_str("  none\n");
    }
    for f in open {
        let subject = f
            .subject
            .as_ref()
            .map(|s| format!(" {s}"))
            .unwrap_or_default();
        out.push_str(&format!(
            "  {}{subject} ({}): {}\n",
            style.yellow(f.type_.as_str()),
            ago(now, f.observed_at.0),
            f.message
        ));
    }

    out.push('\n');
    out.push_str(&style.bold("What to do next"));
    out.push('\n');
    for step in next::steps(input, now) {
        out.push_str(&format!("  - {step}\n"));
    }
    out
}

/// What a quarantine keeps from new work, how, and why that much.
fn fence_line(q: &QuarantineStatus) -> String {
    let what = match q.scope {
        Fenced::Node => "the node (cordoned)".to_owned(),
        Fenced::Gpu => q
            .gpus
            .iter()
            .map(|g| {
                let by = match (&g.rule, g.fence) {
                    (Some(rule), _) => format!("DeviceTaintRule {rule}"),
                    (None, fence) => format!("{fence:?}"),
                };
                format!("{} ({by})", gpu_name(g))
            })
            .collect::<Vec<_>>()
            .join(", "),
    };
    let lifted = q.lifted_at.as_ref().map_or_else(String::new, |t| {
        format!("; lifted {}, its rules going", rfc3339(t.0))
    });
    format!(
        "{what} for {}: {} ({}){lifted}",
        q.incident, q.message, q.why
    )
}

/// What an incident tried, in order: its attempts, then any entries an
/// older release wrote that could not be read as attempts.
fn tried(i: &Incident) -> Vec<String> {
    i.attempts
        .iter()
        .map(Attempt::to_string)
        .chain(i.actions.iter().cloned())
        .collect()
}

/// A diagnostic's verdict on each test, under its attempt.
fn diagnostics(d: &DiagnosticsResult) -> String {
    let version = d
        .dcgm_version
        .as_deref()
        .map(|v| format!(", DCGM {v}"))
        .unwrap_or_default();
    let mut out = format!(
        "                {} diagnostic{version}: {}\n",
        d.level, d.verdict
    );
    for t in &d.tests {
        let gpu = t.gpu.as_deref().unwrap_or("-");
        let detail = t.detail.as_deref().unwrap_or("");
        out.push_str(
            format!(
                "                  {:<22} {gpu:<40} {:<4} {detail}",
                t.name, t.verdict
            )
            .trim_end(),
        );
        out.push('\n');
    }
    out
}

/// One incident, in full.
fn incident(
    i: &Incident,
    status: &GpuNodeHealthStatus,
    now: Timestamp,
    style: Style,
    at: &dyn Fn(&Time) -> String,
) -> String {
    let (outcome, paint) = match i.outcome {
        Some(o @ IncidentOutcome::Recovered) => (o.as_str(), Paint::Green),
        Some(o @ (IncidentOutcome::Failed | IncidentOutcome::Cancelled)) => {
            (o.as_str(), Paint::Red)
        }
        None => ("open", Paint::Yellow),
    };
    let mut out = format!(
        "{} {}: {}\n",
        style.bold("Incident"),
        style.bold(&i.id),
        style.apply(paint, outcome)
    );
    out.push_str(&format!("  trigger    {}\n", i.trigger));
    // Every signal that held when it opened, beyond the trigger itself.
    let others: Vec<&str> = i
        .signals
        .iter()
        .map(|s| s.message.as_str())
        .filter(|m| *m != i.trigger)
        .collect();
    for (n, m) in others.iter().enumerate() {
        let label = if n == 0 { "also" } else { "" };
        out.push_str(&format!("  {label:<9}  {m}\n"));
    }
    out.push_str(&format!("  started    {}\n", at(&i.started_at)));
    let tried = tried(i);
    if tried.is_empty() {
        out.push_str("  actions    none yet\n");
    }
    for (n, a) in tried.iter().enumerate() {
        let label = if n == 0 { "actions" } else { "" };
        out.push_str(&format!("  {label:<9}  {}. {a}\n", n + 1));
        if let Some(d) = i.attempts.get(n).and_then(|a| a.diagnostics.as_ref()) {
            out.push_str(&diagnostics(d));
        }
    }
    match &i.ended_at {
        Some(end) => out.push_str(&format!(
            "  ended      {}  (lasted {})\n",
            at(end),
            duration(end.0.duration_since(i.started_at.0))
        )),
        None => out.push_str(&format!(
            "  ended      not yet (open for {})\n",
            duration(now.duration_since(i.started_at.0))
        )),
    }
    if let Some(w) = &i.workloads {
        let evicted = if w.evicted.is_empty() {
            "none".into()
        } else {
            w.evicted.join(", ")
        };
        out.push_str(&format!("  workloads  evicted {evicted}\n"));
        if let Some(d) = &w.deadline {
            out.push_str(&format!("             deadline {}\n", at(d)));
        }
        // A verdict that is also a finding is told in full once, there.
        let in_findings = status
            .open_findings()
            .any(|f| Some(&f.message) == w.message.as_ref());
        match (&w.outcome, &w.message) {
            (Some(o), Some(_)) if in_findings => {
                out.push_str(&format!("             {o}: see Open findings\n"));
            }
            (Some(o), Some(m)) => out.push_str(&format!("             {o}: {m}\n")),
            (Some(o), None) => out.push_str(&format!("             {o}\n")),
            (None, Some(m)) => out.push_str(&format!("             {m}\n")),
            (None, None) if w.deadline.is_some() => {
                out.push_str("             watched until the deadline\n");
            }
            (None, None) => {}
        }
    }
    for (n, g) in i.gangs.iter().enumerate() {
        let label = if n == 0 { "gangs" } else { "" };
        let open = i.ended_at.is_none();
        out.push_str(&format!(
            "  {label:<9}  {}\n",
            gangs::line(g, open, now, at)
        ));
    }
    out
}

/// The GPUs as the operator last saw them (or the report, before it has).
fn gpus_line(input: &ExplainInput) -> String {
    let from_status: Vec<(u32, String, String, Vec<String>)> = input
        .status
        .gpus
        .iter()
        .map(|g| {
            (
                g.index,
                g.uuid.clone(),
                format!("{:?}", g.health),
                g.pods.iter().map(ToString::to_string).collect(),
            )
        })
        .collect();
    let serving = |h: &str| h == "Healthy" || h == "Degraded";
    let gpus = if from_status.is_empty() {
        input.report.as_ref().map_or_else(
            |_| Vec::new(),
            |r| {
                r.gpus
                    .iter()
                    .map(|g| {
                        let pods = g
                            .pods
                            .iter()
                            .map(|p| PodKey::new(&p.namespace, &p.name).to_string())
                            .collect();
                        (g.index, g.uuid.clone(), format!("{:?}", g.health), pods)
                    })
                    .collect()
            },
        )
    } else {
        from_status
    };
    if gpus.is_empty() {
        return "unknown: no GPU in the status or the report".into();
    }
    let bad: Vec<String> = gpus
        .iter()
        .filter(|g| !serving(&g.2))
        .map(|(index, uuid, health, pods)| {
            let held = if pods.is_empty() {
                String::new()
            } else {
                format!(", held by {}", pods.join(", "))
            };
            format!("GPU {index} ({uuid}) {health}{held}")
        })
        .collect();
    if bad.is_empty() {
        format!("{}, all serving", gpus.len())
    } else {
        format!("{}, not serving: {}", gpus.len(), bad.join("; "))
    }
}

#[cfg(test)]
mod tests;
