//! What in a policy the operator cannot honour as written, field by field.
//! The API server's schema refuses most mistakes; these are the ones it
//! cannot see (a time zone it does not know, a field the engine ignores for
//! that kind of actor), which would otherwise surface only when a node
//! needs them, or never. The operator reports them in the policy's `Ready`
//! condition; nothing acts differently because of them.

use gpuhealth_api::policy::{GpuHealthPolicySpec, OtherActor, SignalSource};

pub use crate::problem::Problem;
use crate::{others::kured_daemonset, windows};

/// The `Ready` condition's reason (and the Event's) while a field of the
/// policy cannot be honoured.
pub const REASON: &str = "CannotHonour";

/// What the spec alone shows cannot be honoured; what only the cluster can
/// show (a lock the operator may not read) the operator adds.
pub fn problems(spec: &GpuHealthPolicySpec) -> Vec<Problem> {
    let mut out = windows::problems(&spec.maintenance_windows);
    out.extend(other_actors(&spec.other_actors));
    out.extend(conditions_not_acted_on(spec));
    out
}

/// Condition rules stored before the CRD refused them, not acted on: one
/// naming no writer (anyone who may patch a Node's status could write it),
/// one on a reserved type (the node lifecycle's own, or `GpuHealthy`).
fn conditions_not_acted_on(spec: &GpuHealthPolicySpec) -> Vec<Problem> {
    let mut out = Vec::new();
    for (i, r) in spec.detection.node_conditions.iter().enumerate() {
        let field = |name: &str| format!("spec.detection.nodeConditions[{i}].{name}");
        if r.reserved() {
            out.push(Problem::new(
                field("type"),
                format!(
                    "{} is the node lifecycle's or gpuhealth's agent's own condition, so it is not acted on: remove the rule",
                    r.type_
                ),
            ));
        } else if r.writers.is_empty() {
            out.push(Problem::new(
                field("writers"),
                format!(
                    "{} names no writer, so it is not acted on: name its detector's identity",
                    r.type_
                ),
            ));
        }
    }
    out
}

/// `otherActors` fields the engine cannot use for their actor's source.
fn other_actors(actors: &[OtherActor]) -> Vec<Problem> {
    let mut out = Vec::new();
    for (i, a) in actors.iter().enumerate() {
        let field = |name: &str| format!("spec.otherActors[{i}].{name}");
        match (a.source, a.object.as_deref()) {
            (SignalSource::KuredLock, Some(object)) => {
                let parts = object.split_once('/');
                if parts.is_none_or(|(ns, name)| ns.is_empty() || name.is_empty()) {
                    let (ns, name) = kured_daemonset(Some(object));
                    let instead = if parts.is_none() {
                        format!(", so the lock is looked for on {ns}/{name} instead")
                    } else {
                        String::new()
                    };
                    out.push(Problem::new(
                        field("object"),
                        format!("{object:?} is not namespace/name{instead}"),
                    ));
                }
            }
            (SignalSource::KuredLock, None) => {}
            (source, Some(_)) => out.push(Problem::new(
                field("object"),
                format!("ignored: only a KuredLock actor reads an object, not a {source:?} one"),
            )),
            (_, None) => {}
        }
        let names_nodes = match a.source {
            SignalSource::KuredLock => Some("its lock names"),
            SignalSource::NodeMaintenance => Some("a NodeMaintenance names"),
            _ => None,
        };
        if let Some(names) = names_nodes {
            for (name, list) in [("values", &a.values), ("exceptValues", &a.except_values)] {
                if !list.is_empty() {
                    out.push(Problem::new(
                        field(name),
                        format!(
                            "ignored for a {:?} actor: every node {names} is held, whatever the value",
                            a.source
                        ),
                    ));
                }
            }
        }
    }
    out
}

/// The operator could not read the lock `actor` (at `index` in the
/// policy's `otherActors`) points at: `error` is why.
pub fn lock_unreadable(index: usize, actor: &OtherActor, error: &str) -> Problem {
    let unseen = "so gpuhealth does not see which nodes it names";
    match actor.source {
        SignalSource::NodeMaintenance => Problem::new(
            format!("spec.otherActors[{index}].key"),
            format!(
                "NodeMaintenance objects of {} cannot be listed ({error}), {unseen}",
                actor.key
            ),
        ),
        _ => {
            let (ns, name) = kured_daemonset(actor.object.as_deref());
            Problem::new(
                format!("spec.otherActors[{index}].object"),
                format!(
                    "{}'s lock on DaemonSet {ns}/{name} cannot be read ({error}), {unseen}",
                    actor.name
                ),
            )
        }
    }
}

/// The `Ready` message for `problems` (none: `None`).
pub fn message(problems: &[Problem]) -> Option<String> {
    if problems.is_empty() {
        return None;
    }
    let each: Vec<String> = problems.iter().map(Problem::to_string).collect();
    Some(each.join("; "))
}

#[cfg(test)]
mod tests {
    use gpuhealth_api::policy::{MaintenanceWindow, default_other_actors};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

    use super::*;

    fn spec() -> GpuHealthPolicySpec {
        GpuHealthPolicySpec::for_selector(LabelSelector::default())
    }

    fn fields(spec: &GpuHealthPolicySpec) -> Vec<String> {
        problems(spec).into_iter().map(|p| p.field).collect()
    }

    #[test]
    fn the_defaults_can_be_honoured() {
        assert!(problems(&spec()).is_empty());
    }

    #[test]
    fn a_condition_rule_that_names_no_writer_is_named() {
        use gpuhealth_api::{
            policy::{ConditionRule, ConditionStatus, ConditionWriter},
            types::SignalAction,
        };
        let rule = |writers| ConditionRule {
            type_: "SysLogsXIDError".into(),
            status: ConditionStatus::True,
            for_: gpuhealth_api::Duration::from_secs(0),
            action: SignalAction::GpuReset,
            writers,
        };
        let mut spec = spec();
        spec.detection.node_conditions = vec![
            rule(vec![ConditionWriter::group("system:nodes")]),
            rule(Vec::new()),
        ];
        let found = problems(&spec);
        assert_eq!(
            fields(&spec),
            ["spec.detection.nodeConditions[1].writers"],
            "{found:?}"
        );
        assert!(
            found[0].to_string().contains("not acted on"),
            "{}",
            found[0]
        );
    }

    #[test]
    fn a_condition_rule_on_a_reserved_type_is_named() {
        use gpuhealth_api::{
            policy::{ConditionRule, ConditionStatus, ConditionWriter},
            types::SignalAction,
        };
        let rule = |type_: &str| ConditionRule {
            type_: type_.into(),
            status: ConditionStatus::False,
            for_: gpuhealth_api::Duration::from_secs(0),
            action: SignalAction::NodeReboot,
            writers: vec![ConditionWriter::group("system:nodes")],
        };
        let mut spec = spec();
        spec.detection.node_conditions =
            vec![rule("SysLogsXIDError"), rule("Ready"), rule("GpuHealthy")];
        let found = problems(&spec);
        assert_eq!(
            fields(&spec),
            [
                "spec.detection.nodeConditions[1].type",
                "spec.detection.nodeConditions[2].type"
            ],
            "{found:?}"
        );
        assert!(
            found[0]
                .to_string()
                .contains("Ready is the node lifecycle's"),
            "{}",
            found[0]
        );
    }

    #[test]
    fn an_unknown_time_zone_is_named_by_its_field() {
        let mut spec = spec();
        let window = |tz: &str| MaintenanceWindow {
            days: Vec::new(),
            start: "22:00".into(),
            end: "06:00".into(),
            time_zone: tz.into(),
        };
        spec.maintenance_windows = vec![window("Europe/Berlin"), window("Mars/Base")];
        let found = problems(&spec);
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].field, "spec.maintenanceWindows[1].timeZone");
        assert!(
            found[0].to_string().starts_with(
                "spec.maintenanceWindows[1].timeZone: unknown time zone \"Mars/Base\""
            ),
            "{}",
            found[0]
        );
        assert_eq!(message(&found), Some(found[0].to_string()));
        spec.maintenance_windows[1].time_zone = "Asia/Tokyo".into();
        assert!(problems(&spec).is_empty());
        assert_eq!(message(&[]), None);
    }

    #[test]
    fn a_kured_object_that_is_not_namespace_slash_name_is_named() {
        let mut spec = spec();
        let kured = spec
            .other_actors
            .iter()
            .position(|a| a.source == SignalSource::KuredLock)
            .expect("kured's lock is a default");
        spec.other_actors[kured].object = Some("kured".into());
        let found = problems(&spec);
        assert_eq!(
            found,
            [Problem::new(
                format!("spec.otherActors[{kured}].object"),
                "\"kured\" is not namespace/name, so the lock is looked for on kube-system/kured instead"
            )]
        );
        for object in ["kube-system/", "/kured"] {
            spec.other_actors[kured].object = Some(object.into());
            assert_eq!(
                fields(&spec),
                [format!("spec.otherActors[{kured}].object")],
                "{object}"
            );
        }
        spec.other_actors[kured].object = Some("kured/kured-gpu".into());
        assert!(problems(&spec).is_empty());
        spec.other_actors[kured].object = None;
        assert!(problems(&spec).is_empty(), "kube-system/kured by default");
    }

    #[test]
    fn fields_the_actors_source_does_not_use_are_named() {
        let mut spec = spec();
        spec.other_actors = default_other_actors();
        // 0: the GPU Operator's label; 1: kured's lock; 3: Medik8s.
        spec.other_actors[0].object = Some("kube-system/gpu-operator".into());
        spec.other_actors[1].values = vec!["gpu-7".into()];
        spec.other_actors[3].except_values = vec!["done".into()];
        assert_eq!(
            fields(&spec),
            [
                "spec.otherActors[0].object",
                "spec.otherActors[1].values",
                "spec.otherActors[3].exceptValues",
            ]
        );
        // On a label, values are what narrow the match: nothing to say.
        spec = self::spec();
        spec.other_actors[0].values = vec!["upgrade-required".into()];
        assert!(problems(&spec).is_empty());
    }

    #[test]
    fn an_unreadable_lock_names_the_field_that_points_at_it() {
        let actors = default_other_actors();
        let kured = lock_unreadable(1, &actors[1], "403 Forbidden");
        assert_eq!(kured.field, "spec.otherActors[1].object");
        assert_eq!(
            kured.message,
            "kured's lock on DaemonSet kube-system/kured cannot be read (403 Forbidden), so gpuhealth does not see which nodes it names"
        );
        let medik8s = lock_unreadable(3, &actors[3], "403 Forbidden");
        assert_eq!(medik8s.field, "spec.otherActors[3].key");
        assert!(
            medik8s.message.starts_with(
                "NodeMaintenance objects of nodemaintenance.medik8s.io cannot be listed"
            ),
            "{}",
            medik8s.message
        );
        let both = message(&[kured, medik8s]).expect("a message");
        assert!(
            both.starts_with("spec.otherActors[1].object: ")
                && both.contains("; spec.otherActors[3].key: "),
            "{both}"
        );
    }
}
