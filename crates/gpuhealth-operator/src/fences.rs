//! gpuhealth's own `DeviceTaintRule`s, each fencing one bad GPU: the
//! version of `resource.k8s.io` they are read and written in (the newest
//! the cluster serves, chosen once at start), their watch, and the rule an
//! incident writes.

use futures::{StreamExt, channel::mpsc::UnboundedSender};
use gpuhealth_api::{
    device_taint_rule::{self, DeviceTaintRule, RuleVersion},
    quarantine::{DEVICE_TAINT_KEY, MANAGED_BY_LABEL, RULE_INCIDENT_LABEL, RULE_NODE_LABEL},
    vocabulary::DeviceId,
};
use gpuhealth_engine::fence::RuleView;
use k8s_openapi::{
    api::{
        core::v1::Node,
        resource::v1beta2::{DeviceTaint, DeviceTaintRuleSpec, DeviceTaintSelector},
    },
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time},
    jiff::Timestamp,
};
use kube::{
    Api, Client, ResourceExt,
    runtime::{
        WatchStreamExt,
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};
use tracing::info;

use crate::discovery::served;

/// gpuhealth's own `DeviceTaintRule`s, from the watch, and the version of
/// `resource.k8s.io` they are read and written in.
pub struct Rules {
    pub store: Store<DeviceTaintRule>,
    pub version: RuleVersion,
}

impl Rules {
    /// The rules, in their version.
    pub fn api(&self, client: &Client) -> Api<DeviceTaintRule> {
        Api::all_with(client.clone(), &self.version)
    }
}

/// Starts the watch of gpuhealth's rules in the newest version the cluster
/// serves; None where it serves none. A change to a rule is sent as its
/// node.
pub async fn watch(client: &Client, changed: UnboundedSender<ObjectRef<Node>>) -> Option<Rules> {
    // `served` takes an unanswered question for a no, as for DRA itself.
    let chosen = RuleVersion::choose(|group_version: String| async move {
        Ok::<_, std::convert::Infallible>(
            served(client, &group_version, device_taint_rule::PLURAL).await,
        )
    })
    .await;
    let Ok(Some(version)) = chosen else {
        info!(
            "the cluster serves no DeviceTaintRules (resource.k8s.io/v1 from Kubernetes 1.37, v1beta2 on 1.36 with the DRADeviceTaintRules gate): on DRA nodes a bad GPU's node is cordoned"
        );
        return None;
    };
    info!(%version, "the cluster serves DeviceTaintRules: a bad GPU can be fenced alone");
    let rule_writer = reflector::store::Writer::<DeviceTaintRule>::new(version);
    let store = rule_writer.as_reader();
    tokio::spawn(
        watcher(
            Api::<DeviceTaintRule>::all_with(client.clone(), &version),
            watcher::Config::default().labels(&ours()),
        )
        .default_backoff()
        .modify(|r| r.managed_fields_mut().clear())
        .reflect(rule_writer)
        .touched_objects()
        .for_each(move |rule| {
            if let Some(node) = rule.ok().as_ref().and_then(node_of) {
                let _ = changed.unbounded_send(ObjectRef::new(&node));
            }
            futures::future::ready(())
        }),
    );
    Some(Rules { store, version })
}

/// The label selector of gpuhealth's own rules.
pub fn ours() -> String {
    format!("{}={}", MANAGED_BY_LABEL.0, MANAGED_BY_LABEL.1)
}

/// The node a rule of ours is for.
pub fn node_of(rule: &DeviceTaintRule) -> Option<String> {
    rule.labels().get(RULE_NODE_LABEL).cloned()
}

/// gpuhealth's rules for `node`, from the watch.
pub fn rules_of(store: &Store<DeviceTaintRule>, node: &str) -> Vec<RuleView> {
    store
        .state()
        .iter()
        .filter(|r| node_of(r).as_deref() == Some(node))
        .map(|r| RuleView {
            name: r.name_any(),
            created: r.metadata.creation_timestamp.as_ref().map(|t| t.0),
            incident: r
                .labels()
                .get(RULE_INCIDENT_LABEL)
                .cloned()
                .unwrap_or_default(),
        })
        .collect()
}

/// The rule, in `version`, that taints `device` `NoSchedule` for
/// `incident` on `node`.
pub fn rule(
    version: RuleVersion,
    name: &str,
    device: &DeviceId,
    incident: &str,
    node: &str,
) -> DeviceTaintRule {
    DeviceTaintRule::new(
        version,
        ObjectMeta {
            name: Some(name.to_owned()),
            labels: Some(
                [
                    (MANAGED_BY_LABEL.0.to_owned(), MANAGED_BY_LABEL.1.to_owned()),
                    (RULE_NODE_LABEL.to_owned(), node.to_owned()),
                    (RULE_INCIDENT_LABEL.to_owned(), incident.to_owned()),
                ]
                .into(),
            ),
            ..ObjectMeta::default()
        },
        DeviceTaintRuleSpec {
            device_selector: Some(DeviceTaintSelector {
                driver: Some(device.driver.clone()),
                pool: Some(device.pool.clone()),
                device: Some(device.device.clone()),
            }),
            taint: DeviceTaint {
                key: DEVICE_TAINT_KEY.to_owned(),
                value: Some(incident.chars().take(63).collect()),
                effect: "NoSchedule".to_owned(),
                time_added: Some(Time(Timestamp::now())),
            },
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rule_selects_one_device_by_driver_pool_and_name() {
        // A pool of several subdomains is selected whole.
        let device = DeviceId::new("gpu.nvidia.com", "rack-1/node-a", "gpu-7");
        let r = rule(
            RuleVersion::V1,
            "gpuhealth-inc-1-ab-gpu-7",
            &device,
            "inc-1-ab",
            "node-a",
        );
        let s = r.spec.device_selector.clone().expect("a selector");
        assert_eq!(s.driver.as_deref(), Some("gpu.nvidia.com"));
        assert_eq!(s.pool.as_deref(), Some("rack-1/node-a"));
        assert_eq!(s.device.as_deref(), Some("gpu-7"));
        assert_eq!(r.spec.taint.effect, "NoSchedule");
        assert_eq!(node_of(&r).as_deref(), Some("node-a"));
        assert_eq!(r.api_version, "resource.k8s.io/v1");
    }
}
