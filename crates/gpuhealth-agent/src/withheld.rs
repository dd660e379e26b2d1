//! What the executor says when a check its offer stands on
//! ([`crate::capability_checks`]) starts or stops failing: the gauge
//! `gpuhealth_agent_capability_withheld{capability,check}` at once, and an
//! Event on its Node once per change: a Warning `CapabilityWithheld` with
//! the reason when a check fails, a Normal `CapabilityOffered` when one
//! that failed passes again (one that passes from the start says
//! nothing). An Event that could not be published is tried again on the
//! next pass: what is said follows what the checks last found.

use std::collections::BTreeMap;

use k8s_openapi::{
    api::{core::v1::Node, events::v1 as events},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};
use kube::{Api, Client, Resource, ResourceExt};
use prometheus_client::metrics::{family::Family, gauge::Gauge};
use tracing::warn;

use crate::{
    capability_checks::{CapabilityChecks, Check},
    metrics::WithheldLabels,
};

/// The Event reasons.
pub const WITHHELD: &str = "CapabilityWithheld";
pub const OFFERED: &str = "CapabilityOffered";

/// What a check's result calls for, given what was last said of it.
#[derive(Debug, PartialEq, Eq)]
enum Say {
    Nothing,
    Withheld(String),
    Offered,
}

/// `was`: whether the check was last said failing (`None`: nothing said).
fn what_to_say(was: Option<bool>, now: &Result<(), String>) -> Say {
    match (was, now) {
        (None | Some(false), Err(why)) => Say::Withheld(why.clone()),
        (Some(true), Ok(())) => Say::Offered,
        _ => Say::Nothing,
    }
}

/// What has been said of each check.
#[derive(Debug, Default)]
pub struct Announced {
    /// Whether each check was last said failing.
    said: BTreeMap<Check, bool>,
}

impl Announced {
    /// Sets the gauge from `checks`, and says on `node` what changed.
    pub async fn announce(
        &mut self,
        client: &Client,
        node: &Node,
        checks: &CapabilityChecks,
        gauge: &Family<WithheldLabels, Gauge>,
    ) {
        for (check, result) in checks.results() {
            gauge
                .get_or_create(&WithheldLabels::of(check))
                .set(i64::from(result.is_err()));
            let event = match what_to_say(self.said.get(&check).copied(), result) {
                Say::Nothing => None,
                Say::Withheld(why) => Some(event(node, check, Some(&why))),
                Say::Offered => Some(event(node, check, None)),
            };
            if let Some(event) = event {
                let events: Api<events::Event> = Api::namespaced(client.clone(), "default");
                if let Err(e) = events.create(&crate::post_params(), &event).await {
                    warn!(%check, error = %e, "could not publish the check's Event; will retry");
                    continue;
                }
            }
            self.said.insert(check, result.is_err());
        }
    }
}

/// The Event about `node`: `check` failing, and why, or passing again.
fn event(node: &Node, check: Check, failing: Option<&str>) -> events::Event {
    let capability = check.capability().as_str();
    let (type_, reason, note) = match failing {
        Some(why) => (
            "Warning",
            WITHHELD,
            format!("no {capability} offered: the check {check} fails: {why}"),
        ),
        None => (
            "Normal",
            OFFERED,
            format!("{capability} offered again: the check {check} passes"),
        ),
    };
    let mut prefix = format!("{}.capability-", node.name_any());
    // generateName adds five characters to at most 253.
    prefix.truncate(240);
    events::Event {
        metadata: ObjectMeta {
            generate_name: Some(prefix),
            namespace: Some("default".into()),
            ..Default::default()
        },
        event_time: Some(MicroTime(Timestamp::now())),
        type_: Some(type_.into()),
        reason: Some(reason.into()),
        action: Some("CheckCapability".into()),
        note: Some(note.chars().take(1000).collect()),
        regarding: Some(node.object_ref(&())),
        reporting_controller: Some("gpuhealth.io/agent".into()),
        reporting_instance: Some(node.name_any().chars().take(128).collect()),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Said once per change: a failure when first seen or after a pass, a
    /// pass only after a failure, nothing while the state holds (a new
    /// reason for the same failure included).
    #[test]
    fn each_change_is_said_once() {
        let failing = Err("cannot follow /proc/41/fd/0".to_owned());
        let passing = Ok(());
        assert_eq!(
            what_to_say(None, &failing),
            Say::Withheld("cannot follow /proc/41/fd/0".into())
        );
        assert_eq!(what_to_say(None, &passing), Say::Nothing);
        assert_eq!(what_to_say(Some(true), &failing), Say::Nothing);
        assert_eq!(
            what_to_say(Some(true), &Err("another reason".into())),
            Say::Nothing
        );
        assert_eq!(what_to_say(Some(true), &passing), Say::Offered);
        assert_eq!(what_to_say(Some(false), &passing), Say::Nothing);
        assert!(matches!(
            what_to_say(Some(false), &failing),
            Say::Withheld(_)
        ));
    }

    #[test]
    fn the_event_is_about_the_node_and_says_why() {
        let node = Node {
            metadata: ObjectMeta {
                name: Some("gpu-7".into()),
                ..Default::default()
            },
            ..Default::default()
        };
        let e = event(&node, Check::HostProcesses, Some("Permission denied"));
        assert_eq!(e.type_.as_deref(), Some("Warning"));
        assert_eq!(e.reason.as_deref(), Some(WITHHELD));
        assert_eq!(
            e.note.as_deref(),
            Some("no reset offered: the check HostProcesses fails: Permission denied")
        );
        let about = e.regarding.expect("regarding");
        assert_eq!(
            (about.kind.as_deref(), about.name.as_deref()),
            (Some("Node"), Some("gpu-7"))
        );
        assert_eq!(e.metadata.namespace.as_deref(), Some("default"));
        let e = event(&node, Check::Logind, None);
        assert_eq!(
            (e.type_.as_deref(), e.reason.as_deref()),
            (Some("Normal"), Some(OFFERED))
        );
        assert_eq!(
            e.note.as_deref(),
            Some("reboot offered again: the check Logind passes")
        );
    }
}
