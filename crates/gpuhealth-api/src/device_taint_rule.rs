//! `DeviceTaintRule` in whichever `resource.k8s.io` version the cluster
//! serves it: `v1` from Kubernetes 1.37 (GA, on by default), `v1beta2` on
//! 1.36 with the `DRADeviceTaintRules` feature gate, none elsewhere.
//!
//! The two versions have the same fields. k8s-openapi is built for the
//! oldest minor gpuhealth supports (its `v1_36` feature), whose types have
//! no `v1` rule; so one type of ours carries k8s-openapi's `v1beta2` spec
//! and status, and is read and written in the version chosen at start,
//! which kube takes as its dynamic type: `Api::all_with(client, &version)`.

use std::borrow::Cow;

use k8s_openapi::{
    ClusterResourceScope,
    api::resource::v1beta2::{DeviceTaintRuleSpec, DeviceTaintRuleStatus},
    apimachinery::pkg::apis::meta::v1::ObjectMeta,
};
use serde::{Deserialize, Serialize};

/// The API group of `DeviceTaintRule`.
pub const GROUP: &str = "resource.k8s.io";
/// Its resource name, as discovery lists it.
pub const PLURAL: &str = "devicetaintrules";

/// A version of `resource.k8s.io` that serves `DeviceTaintRule`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RuleVersion {
    /// GA, Kubernetes 1.37 on.
    V1,
    /// Beta, Kubernetes 1.36 with `DRADeviceTaintRules` on.
    V1beta2,
}

impl RuleVersion {
    /// Newest first: the one to use is the first the cluster serves.
    pub const PREFERRED: [RuleVersion; 2] = [RuleVersion::V1, RuleVersion::V1beta2];

    pub fn as_str(self) -> &'static str {
        match self {
            RuleVersion::V1 => "v1",
            RuleVersion::V1beta2 => "v1beta2",
        }
    }

    /// `resource.k8s.io/<version>`, as discovery and `apiVersion` name it.
    pub fn group_version(self) -> String {
        format!("{GROUP}/{}", self.as_str())
    }

    /// The version to read and write rules in: the first of
    /// [`RuleVersion::PREFERRED`] for which `serves` (asked with a group
    /// version) says the cluster lists `devicetaintrules`; None when it
    /// serves neither; the first error `serves` gives, if any.
    pub async fn choose<F, Fut, E>(serves: F) -> Result<Option<RuleVersion>, E>
    where
        F: Fn(String) -> Fut,
        Fut: Future<Output = Result<bool, E>>,
    {
        for version in RuleVersion::PREFERRED {
            if serves(version.group_version()).await? {
                return Ok(Some(version));
            }
        }
        Ok(None)
    }
}

impl std::fmt::Display for RuleVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.group_version())
    }
}

/// A `DeviceTaintRule`, in the version its `apiVersion` names (empty in a
/// list's items, which the API server sends without it).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeviceTaintRule {
    #[serde(default)]
    pub api_version: String,
    #[serde(default)]
    pub kind: String,
    #[serde(default)]
    pub metadata: ObjectMeta,
    pub spec: DeviceTaintRuleSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<DeviceTaintRuleStatus>,
}

impl DeviceTaintRule {
    /// A rule to create in `version`.
    pub fn new(version: RuleVersion, metadata: ObjectMeta, spec: DeviceTaintRuleSpec) -> Self {
        DeviceTaintRule {
            api_version: version.group_version(),
            kind: "DeviceTaintRule".to_owned(),
            metadata,
            spec,
            status: None,
        }
    }
}

impl kube::Resource for DeviceTaintRule {
    type DynamicType = RuleVersion;
    type Scope = ClusterResourceScope;

    fn kind(_: &RuleVersion) -> Cow<'_, str> {
        "DeviceTaintRule".into()
    }

    fn group(_: &RuleVersion) -> Cow<'_, str> {
        GROUP.into()
    }

    fn version(version: &RuleVersion) -> Cow<'_, str> {
        version.as_str().into()
    }

    fn plural(_: &RuleVersion) -> Cow<'_, str> {
        PLURAL.into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served(
        versions: &'static [&'static str],
    ) -> impl Fn(String) -> std::future::Ready<Result<bool, String>> {
        move |gv| std::future::ready(Ok(versions.contains(&gv.as_str())))
    }

    #[tokio::test]
    async fn the_newest_served_version_is_chosen() {
        let both = served(&["resource.k8s.io/v1", "resource.k8s.io/v1beta2"]);
        assert_eq!(RuleVersion::choose(both).await, Ok(Some(RuleVersion::V1)));
        let beta = served(&["resource.k8s.io/v1beta2"]);
        assert_eq!(
            RuleVersion::choose(beta).await,
            Ok(Some(RuleVersion::V1beta2))
        );
        assert_eq!(RuleVersion::choose(served(&[])).await, Ok(None));
        // An unanswered question is not a "no".
        let failing = |_| std::future::ready(Err::<bool, _>("unreachable".to_owned()));
        assert_eq!(
            RuleVersion::choose(failing).await,
            Err("unreachable".to_owned())
        );
    }

    #[test]
    fn a_rule_is_written_in_its_version_and_read_back() {
        use kube::Resource;
        let rule = DeviceTaintRule::new(
            RuleVersion::V1,
            ObjectMeta {
                name: Some("r".into()),
                ..Default::default()
            },
            DeviceTaintRuleSpec::default(),
        );
        let json = serde_json::to_value(&rule).expect("serialises");
        assert_eq!(json["apiVersion"], "resource.k8s.io/v1");
        assert_eq!(json["kind"], "DeviceTaintRule");
        let back: DeviceTaintRule = serde_json::from_value(json).expect("deserialises");
        assert_eq!(back, rule);
        // As a list's item: no apiVersion, no kind.
        let item: DeviceTaintRule =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "r"}, "spec": {"taint": {"key": "k", "effect": "NoSchedule"}}}))
                .expect("a list's item");
        assert_eq!(item.metadata.name.as_deref(), Some("r"));
        assert_eq!(
            DeviceTaintRule::url_path(&RuleVersion::V1beta2, None),
            "/apis/resource.k8s.io/v1beta2/devicetaintrules"
        );
    }
}
