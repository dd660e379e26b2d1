//! The gangs an incident acted on, as explain tells them: how each left,
//! from the incident's record, and what a drain still waits on.

use gpuhealth_api::{
    GpuNodeHealthStatus,
    gang::{
        DISRUPTION_PENDING_CONDITION, EVICT_AT_ANNOTATION, GANG_NODES_LIMIT, GangMode, GangRecord,
    },
    node_health::Phase,
    vocabulary::Reason,
};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};

use crate::output::{ago, rfc3339};

/// How gang `g` of an incident left, in one line; `open` while the
/// incident is, when a notice still counts down to `now`'s future.
pub fn line(g: &GangRecord, open: bool, now: Timestamp, at: &dyn Fn(&Time) -> String) -> String {
    let how = match g.mode {
        GangMode::Member => {
            "only the holder moves, evicted as any pod; the gang's controller decides the rest"
                .to_owned()
        }
        GangMode::Never => {
            "gpuhealth evicts none of it: the gang's controller or a person moves its members"
                .to_owned()
        }
        GangMode::Whole => whole(g, open, now, at),
    };
    format!("{} ({:?}): {}; {how}", g.gang, g.mode, counted(g))
}

/// Under `Whole`: told, then evicted together, or restarting on its own.
fn whole(g: &GangRecord, open: bool, now: Timestamp, at: &dyn Fn(&Time) -> String) -> String {
    let told = |t: &Time| format!("told they leave together at {}", at(t));
    if g.restarted_on_its_own {
        let first = g
            .evict_at
            .as_ref()
            .map_or_else(String::new, |t| told(t) + "; ");
        return format!("{first}restarting on its own: not evicted twice");
    }
    match (&g.evict_at, &g.evicted_at) {
        // Without notice (`drain.gangs.notice: 0s`) both are the same instant.
        (Some(t), Some(e)) if t != e => format!("{}; evicted together at {}", told(t), at(e)),
        (_, Some(e)) => format!("evicted together at {}", at(e)),
        (Some(t), None) if open && t.0 > now => format!("{} ({})", told(t), ago(now, t.0)),
        (Some(t), None) if open => format!("{} (due {}); not evicted yet", told(t), ago(now, t.0)),
        (Some(t), None) => format!("{}; not evicted: the incident ended first", told(t)),
        (None, None) if open => "not told yet".into(),
        // Its members left otherwise: with another node's incident, or
        // before their turn came.
        (None, None) => "not evicted by this incident".into(),
    }
}

/// `32 members on 4 nodes`, as last counted.
fn counted(g: &GangRecord) -> String {
    if g.members == 0 && g.nodes.is_empty() {
        return "members not counted yet".into();
    }
    let members = plural(g.members as usize, "member");
    // The record keeps at most GANG_NODES_LIMIT of them.
    let nodes = match g.nodes.len() {
        n if n >= GANG_NODES_LIMIT => format!("{n} or more nodes"),
        n => plural(n, "node"),
    };
    format!("{members} on {nodes}")
}

fn plural(n: usize, word: &str) -> String {
    if n == 1 {
        format!("1 {word}")
    } else {
        format!("{n} {word}s")
    }
}

/// While the node drains for its open incident, the gangs the drain waits
/// on, one step each.
pub fn waits(s: &GpuNodeHealthStatus, node: &str, now: Timestamp) -> Vec<String> {
    let Some(incident) = s.history.first().filter(|i| i.ended_at.is_none()) else {
        return Vec::new();
    };
    if s.phase != Phase::Draining {
        return Vec::new();
    }
    let mut steps = Vec::new();
    for g in incident.gangs.iter().filter(|g| g.evicted_at.is_none()) {
        let gang = &g.gang;
        match (g.mode, &g.evict_at) {
            (GangMode::Whole, _) if g.restarted_on_its_own => steps.push(format!(
                "wait: {gang} is restarting on its own, so gpuhealth does not evict it twice; the drain goes on once its members on {node} have left"
            )),
            (GangMode::Whole, Some(t)) if t.0 > now => steps.push(format!(
                "wait: {gang} leaves together at {} ({}): its {} are told (annotation {EVICT_AT_ANNOTATION}, condition {DISRUPTION_PENDING_CONDITION}), time to checkpoint; then all are deleted at once",
                rfc3339(t.0),
                ago(now, t.0),
                counted(g)
            )),
            (GangMode::Whole, Some(t)) => steps.push(format!(
                "wait: {gang} was due to leave together at {} ({}); all its members are deleted at once when every PodDisruptionBudget covering any of them allows a disruption",
                rfc3339(t.0),
                ago(now, t.0)
            )),
            // Its member is then the pod the drain waits for.
            (GangMode::Never, _) if s.reason == Some(Reason::WaitingForPod) => steps.push(format!(
                "{gang} is never evicted by gpuhealth (drain.gangs.mode Never): while its members hold the drain, move them off {node} through the gang's controller, or delete them"
            )),
            (GangMode::Whole, None) | (GangMode::Member | GangMode::Never, _) => {}
        }
    }
    steps
}
