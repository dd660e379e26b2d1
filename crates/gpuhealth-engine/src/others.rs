//! Other tools that disrupt nodes: the GPU Operator's driver upgrades,
//! kured's reboots, Medik8s maintenance. Remediations that ignore each other
//! take down more capacity than anyone allowed.

use std::collections::BTreeMap;

use gpuhealth_api::policy::{OtherActor, SignalSource};

/// A Node's labels, annotations and taints (key to value; a taint without
/// a value maps to ""), and what names it elsewhere: for each `KuredLock`
/// or `NodeMaintenance` actor (by name) that names the node, how.
#[derive(Clone, Copy, Debug)]
pub struct NodeSignals<'a> {
    pub labels: &'a BTreeMap<String, String>,
    pub annotations: &'a BTreeMap<String, String>,
    pub taints: &'a BTreeMap<String, String>,
    pub named_by: &'a BTreeMap<String, String>,
}

/// Which of `actors` are disrupting the node now, in words
/// (`gpu-operator: label nvidia.com/gpu-driver-upgrade-state=upgrade-required`).
pub fn disruptions(actors: &[OtherActor], node: NodeSignals<'_>) -> Vec<String> {
    actors
        .iter()
        .filter_map(|a| {
            let (map, what) = match a.source {
                SignalSource::Label => (node.labels, "label"),
                SignalSource::Annotation => (node.annotations, "annotation"),
                SignalSource::Taint => (node.taints, "taint"),
                SignalSource::KuredLock | SignalSource::NodeMaintenance => {
                    return node
                        .named_by
                        .get(&a.name)
                        .map(|how| format!("{}: {how}", a.name));
                }
            };
            let value = map.get(&a.key)?;
            let listed = a.values.is_empty() || a.values.contains(value);
            let excepted = a.except_values.contains(value);
            (listed && !excepted).then(|| format!("{}: {what} {}={value}", a.name, a.key))
        })
        .collect()
}

/// kured's DaemonSet as a `KuredLock` actor's `object` names it
/// (`namespace/name`): `kube-system/kured` when unset, or when it is not
/// `namespace/name` (which the policy's `Ready` condition then says).
pub fn kured_daemonset(object: Option<&str>) -> (&str, &str) {
    object
        .unwrap_or("kube-system/kured")
        .split_once('/')
        .unwrap_or(("kube-system", "kured"))
}

#[cfg(test)]
mod tests {
    use gpuhealth_api::policy::default_other_actors;

    use super::*;

    fn map(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn the_defaults_see_a_driver_upgrade_a_kured_reboot_and_a_medik8s_drain() {
        let actors = default_other_actors();
        let none = map(&[]);
        let check = |labels: &BTreeMap<String, String>,
                     annotations: &BTreeMap<String, String>,
                     taints: &BTreeMap<String, String>| {
            disruptions(
                &actors,
                NodeSignals {
                    labels,
                    annotations,
                    taints,
                    named_by: &none,
                },
            )
        };
        let upgrading = map(&[("nvidia.com/gpu-driver-upgrade-state", "upgrade-required")]);
        assert_eq!(
            check(&upgrading, &none, &none),
            ["gpu-operator: label nvidia.com/gpu-driver-upgrade-state=upgrade-required"]
        );
        let done = map(&[("nvidia.com/gpu-driver-upgrade-state", "upgrade-done")]);
        assert!(
            check(&done, &none, &none).is_empty(),
            "upgrade-done is not a disruption"
        );
        let kured = map(&[(
            "weave.works/kured-reboot-in-progress",
            "2026-05-29T08:00:00Z",
        )]);
        assert_eq!(check(&none, &kured, &none).len(), 1);
        let medik8s = map(&[("medik8s.io/drain", "")]);
        assert_eq!(check(&none, &none, &medik8s).len(), 1);
        assert!(check(&none, &none, &none).is_empty());
        // kured's lock and a NodeMaintenance, as the operator found them.
        let named = map(&[(
            "kured",
            "lock weave.works/kured-node-lock on kube-system/kured",
        )]);
        let found = disruptions(
            &actors,
            NodeSignals {
                labels: &none,
                annotations: &none,
                taints: &none,
                named_by: &named,
            },
        );
        assert_eq!(
            found,
            ["kured: lock weave.works/kured-node-lock on kube-system/kured"]
        );
    }

    #[test]
    fn listed_values_narrow_the_match() {
        let actors = [OtherActor {
            name: "ops".into(),
            source: SignalSource::Label,
            key: "example.com/state".into(),
            object: None,
            values: vec!["draining".into()],
            except_values: Vec::new(),
        }];
        let none = map(&[]);
        let signals = |labels| NodeSignals {
            labels,
            annotations: &none,
            taints: &none,
            named_by: &none,
        };
        let draining = map(&[("example.com/state", "draining")]);
        let idle = map(&[("example.com/state", "idle")]);
        assert_eq!(disruptions(&actors, signals(&draining)).len(), 1);
        assert!(disruptions(&actors, signals(&idle)).is_empty());
    }
}
