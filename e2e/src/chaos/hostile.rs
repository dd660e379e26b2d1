//! Hostile input: while remediations run on the fleet's nodes, a broken or
//! hostile producer writes gpuhealth's annotations on two more nodes of the
//! same policy (nodes with no agent, so that it is their only writer):
//! malformed, oversize, of an unknown version, with unknown enum values,
//! stamped an hour in the future. None of it may act on those nodes
//! (no cordon, no rule, no request of gpuhealth's), and no replica may fall
//! over.

use gpuhealth_api::contract::{
    AnnotationValue, CORDONED_BY_ANNOTATION, GPU_REPORT_ANNOTATION, MAINTENANCE_ANNOTATION,
    MAX_VALUE_BYTES, REQUEST_RESULT_ANNOTATION, RESET_REQUEST_ANNOTATION,
};
use k8s_openapi::{
    api::core::v1::Node,
    apimachinery::pkg::{apis::meta::v1::Time, util::intstr::IntOrString},
    jiff::{SignedDuration, Timestamp},
};
use kube::{
    Api,
    api::{Patch, PatchParams, PostParams},
    runtime::watcher,
};
use serde_json::json;

use super::{Fault, Rng, Row, fleet::Fleet, policy};
use crate::{
    Result,
    invariants::{Seen, Target, Violation},
    reports,
    sim::{GpuNodeSpec, SIM_GROUP_LABEL, gpu_node, node_is_ready},
    wait::until_set,
};

/// One hostile value: the annotation and what is written in it.
fn hostile(which: usize) -> (&'static str, String) {
    let healthy = reports::healthy("hostile", &[]);
    match which {
        0 => (GPU_REPORT_ANNOTATION, r#"{"version":1,"gpus":["#.into()),
        1 => (
            GPU_REPORT_ANNOTATION,
            format!(
                r#"{{"version":1,"pad":"{}"}}"#,
                "a".repeat(MAX_VALUE_BYTES + 1)
            ),
        ),
        2 => {
            let mut v = serde_json::to_value(&healthy).unwrap_or_default();
            v["gpus"][3]["health"] = json!("OnFire");
            (GPU_REPORT_ANNOTATION, v.to_string())
        }
        3 => {
            let mut v = serde_json::to_value(&healthy).unwrap_or_default();
            v["version"] = json!(99);
            (GPU_REPORT_ANNOTATION, v.to_string())
        }
        4 => {
            // Healthy, but from a clock an hour ahead.
            let mut r = healthy;
            r.observed_at = Time(
                Timestamp::now()
                    .saturating_add(SignedDuration::from_hours(1))
                    .unwrap_or_else(|_| Timestamp::now()),
            );
            (GPU_REPORT_ANNOTATION, r.to_annotation())
        }
        5 => (
            MAINTENANCE_ANNOTATION,
            r#"{"deadline":"soon","source":""}"#.into(),
        ),
        6 => (
            RESET_REQUEST_ANNOTATION,
            r#"{"id":"../../x","gpus":[]}"#.into(),
        ),
        7 => (
            REQUEST_RESULT_ANNOTATION,
            r#"{"id":"inc-1-reset-1","outcome":"Exploded","finishedAt":"2026-11-30T00:00:00Z"}"#
                .into(),
        ),
        _ => (CORDONED_BY_ANNOTATION, "\u{202e}not json at all".into()),
    }
}

const HOSTILE_KINDS: usize = 9;

pub async fn run(trials: usize, rng: &mut Rng) -> Result<Row> {
    let spec = policy(2, IntOrString::String("100%".into()));
    let mut fleet = Fleet::new("chaos-hostile", 6, spec, 2).await?;
    let targets = hostile_nodes(&fleet).await?;
    let mut row = Row::new("hostile input");
    let mut written = 0;
    for _ in 0..trials {
        let mark = fleet.recorder.mark();
        let targets_ = targets.clone();
        let faulty = 1 + rng.below(2);
        let (expect, mut violations) = fleet
            .trial(rng, faulty, &Fault::ALL, async |fleet, rng| {
                for node in &targets_ {
                    let (key, value) = hostile(rng.below(HOSTILE_KINDS));
                    let patch = json!({"metadata": {"annotations": {key: value}}});
                    Api::<Node>::all(fleet.s.client.clone())
                        .patch(node, &PatchParams::default(), &Patch::Merge(patch))
                        .await?;
                }
                Ok(Vec::new())
            })
            .await?;
        written += targets.len();
        for seen in fleet.recorder.since(mark) {
            let acted = match &seen {
                Seen::Cordon {
                    node,
                    unschedulable: true,
                    ..
                }
                | Seen::Fence { node, up: true, .. }
                    if targets.contains(node) =>
                {
                    Some(node.clone())
                }
                // The hostile writer's own unreadable requests act on nothing.
                Seen::Request { node, target, .. }
                    if targets.contains(node) && *target != Target::Unreadable =>
                {
                    Some(node.clone())
                }
                _ => None,
            };
            if let Some(node) = acted {
                violations.push(Violation::Missing {
                    what: format!("hostile input on {node} was acted on: {seen:?}"),
                });
            }
        }
        row.add_trial(&expect, violations);
    }
    row.faults += written;
    if !fleet.exited.is_empty() {
        row.violations.push(Violation::Missing {
            what: format!(
                "{} replica(s) exited during hostile input",
                fleet.exited.len()
            ),
        });
    }
    row.notes.push(format!(
        "{written} hostile annotation values written on nodes without an agent (malformed, oversize, unknown version or enum value, from the future)"
    ));
    fleet.add_notes(&mut row);
    Ok(row)
}

/// Two nodes of the fleet's policy that no agent serves, Ready.
async fn hostile_nodes(fleet: &Fleet) -> Result<Vec<String>> {
    let api: Api<Node> = Api::all(fleet.s.client.clone());
    let names: Vec<String> = (0..2)
        .map(|i| format!("{}-hostile-{i}", fleet.s.group))
        .collect();
    for name in &names {
        let mut node = gpu_node(name, &fleet.s.group, &GpuNodeSpec::default());
        let report = reports::healthy("hostile", &[]);
        node.metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(GPU_REPORT_ANNOTATION.into(), report.to_annotation());
        api.create(&PostParams::default(), &node).await?;
    }
    let selector =
        watcher::Config::default().labels(&format!("{SIM_GROUP_LABEL}={}", fleet.s.group));
    let wanted = names.clone();
    until_set(
        api,
        selector,
        "hostile nodes Ready",
        super::fleet::SETTLE,
        |set| wanted.iter().all(|n| set.get(n).is_some_and(node_is_ready)),
    )
    .await?;
    Ok(names)
}
