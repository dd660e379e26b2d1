//! Gangs: pods that only make progress together (the ranks of a training
//! job, the leader and workers of a serving group). One member gone leaves
//! the rest hung at their next collective, so a drain treats the gang as
//! one. Which gang a pod is in is read from what the field's job
//! controllers and gang schedulers write on their pods; a policy can name
//! a label of its own.

use std::fmt;

use k8s_openapi::{api::core::v1::Pod, apimachinery::pkg::apis::meta::v1::Time};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::duration::Duration;

/// Pod annotation written by gpuhealth on every member of a gang it is
/// about to evict: the time (RFC 3339) at which they are evicted together.
/// A trainer can read it (the downward API mounts annotations as a file)
/// and checkpoint before then.
pub const EVICT_AT_ANNOTATION: &str = "gpuhealth.io/evict-at";
/// Pod condition written with [`EVICT_AT_ANNOTATION`]: `True` while the
/// pod's gang waits to be evicted together; its message says why and when.
pub const DISRUPTION_PENDING_CONDITION: &str = "gpuhealth.io/disruption-pending";
/// The reason of the `DisruptionTarget` condition gpuhealth writes on a
/// gang's members before it deletes them, as the API server writes
/// `EvictionByEvictionAPI` on an evicted pod: a Job's `podFailurePolicy`
/// rule `action: Ignore` on `onPodConditions: [{type: DisruptionTarget}]`
/// keeps the restart off the job's `backoffLimit`.
pub const DISRUPTION_TARGET_REASON: &str = "EvictionByGpuHealth";

/// Labels and annotations that name a pod's gang.
pub const JOBSET_NAME_LABEL: &str = "jobset.sigs.k8s.io/jobset-name";
pub const LWS_NAME_LABEL: &str = "leaderworkerset.sigs.k8s.io/name";
pub const LWS_GROUP_INDEX_LABEL: &str = "leaderworkerset.sigs.k8s.io/group-index";
pub const KUEUE_POD_GROUP_LABEL: &str = "kueue.x-k8s.io/pod-group-name";
pub const VOLCANO_GROUP_ANNOTATION: &str = "scheduling.k8s.io/group-name";
pub const KAI_POD_GROUP_ANNOTATION: &str = "pod-group-name";
pub const COSCHEDULING_POD_GROUP_LABEL: &str = "scheduling.x-k8s.io/pod-group";

crate::vocabulary::words! {
    /// What says a pod is one of a gang.
    pub enum GangSource {
        /// The label the policy names in `drain.gangs.labelKey`.
        PolicyLabel,
        /// Kubernetes' own `spec.schedulingGroup.podGroupName` (the
        /// Workload and PodGroup API).
        PodGroup,
        /// `jobset.sigs.k8s.io/jobset-name`: every pod of a JobSet.
        JobSet,
        /// `leaderworkerset.sigs.k8s.io/name` and `group-index`: one group
        /// of a LeaderWorkerSet (its leader and workers).
        LeaderWorkerSet,
        /// `kueue.x-k8s.io/pod-group-name`: a Kueue pod group.
        Kueue,
        /// `scheduling.k8s.io/group-name`: a Volcano PodGroup.
        Volcano,
        /// `pod-group-name`: a KAI Scheduler PodGroup.
        Kai,
        /// `scheduling.x-k8s.io/pod-group`: the scheduler-plugins
        /// coscheduling PodGroup.
        Coscheduling,
    }
}

/// How a drain treats a pod that is one of a gang.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum GangMode {
    /// The whole gang leaves together: every member, wherever it runs, is
    /// told (`gpuhealth.io/evict-at` and the `gpuhealth.io/disruption-pending`
    /// condition), then, after `notice`, all are deleted at once with the
    /// `DisruptionTarget` condition, under the budgets covering any of them.
    /// Never a part of the gang gone and the rest left hung.
    #[default]
    Whole,
    /// Only the members on the GPUs the step acts on are evicted, as any
    /// pod is; the gang's controller decides the rest.
    Member,
    /// A gang's member holds the step back, as a pod that tolerates no
    /// disruption does: a person or the gang's controller moves it.
    Never,
}

/// `spec.drain.gangs`: how a drain treats pods that run as one of a gang.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GangDrain {
    #[serde(default)]
    pub mode: GangMode,
    /// Under `Whole`, how long every member is told before the gang is
    /// deleted together: time for a trainer to checkpoint. At most half of
    /// `drain.timeout`, which it counts within, so that the gang has the
    /// rest to leave: a longer notice is cut to that.
    #[serde(default = "default_notice")]
    #[schemars(extend("x-kubernetes-validations" = [{
        "rule": "duration(self) >= duration('0s') && duration(self) <= duration('1h')",
        "message": "drain.gangs.notice must be from 0s to 1h"
    }]))]
    pub notice: Duration,
    /// A pod label whose value names the pod's gang, for gangs that no
    /// known controller or scheduler marks; it comes before every other mark.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 317))]
    pub label_key: Option<String>,
}

fn default_notice() -> Duration {
    Duration::from_secs(60)
}

impl Default for GangDrain {
    fn default() -> Self {
        GangDrain {
            mode: GangMode::default(),
            notice: default_notice(),
            label_key: None,
        }
    }
}

/// A gang, named by what says so, its namespace and its name.
#[derive(
    Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct GangKey {
    pub source: GangSource,
    pub namespace: String,
    /// For a LeaderWorkerSet, `<name>-<group index>`, as its leader pod is named.
    pub name: String,
}

impl fmt::Display for GangKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}/{}", self.source, self.namespace, self.name)
    }
}

impl GangKey {
    /// The gang `pod` is one of, if any. The policy's own label comes
    /// first (the user said so), then Kubernetes' own field, then the
    /// controllers' and schedulers' marks.
    pub fn of(pod: &Pod, policy_label: Option<&str>) -> Option<GangKey> {
        let namespace = pod.metadata.namespace.clone().unwrap_or_default();
        let labels = pod.metadata.labels.as_ref();
        let annotations = pod.metadata.annotations.as_ref();
        let label = |k: &str| {
            labels
                .and_then(|l| l.get(k))
                .filter(|v| !v.is_empty())
                .cloned()
        };
        let annotation = |k: &str| {
            annotations
                .and_then(|a| a.get(k))
                .filter(|v| !v.is_empty())
                .cloned()
        };
        let pod_group = || {
            pod.spec
                .as_ref()
                .and_then(|s| s.scheduling_group.as_ref())
                .and_then(|g| g.pod_group_name.clone())
                .filter(|n| !n.is_empty())
        };
        let lws = || {
            Some(format!(
                "{}-{}",
                label(LWS_NAME_LABEL)?,
                label(LWS_GROUP_INDEX_LABEL)?
            ))
        };
        let (source, name) = None
            .or_else(|| Some((GangSource::PolicyLabel, label(policy_label?)?)))
            .or_else(|| Some((GangSource::PodGroup, pod_group()?)))
            .or_else(|| Some((GangSource::JobSet, label(JOBSET_NAME_LABEL)?)))
            .or_else(|| Some((GangSource::LeaderWorkerSet, lws()?)))
            .or_else(|| Some((GangSource::Kueue, label(KUEUE_POD_GROUP_LABEL)?)))
            .or_else(|| Some((GangSource::Volcano, annotation(VOLCANO_GROUP_ANNOTATION)?)))
            .or_else(|| Some((GangSource::Kai, annotation(KAI_POD_GROUP_ANNOTATION)?)))
            .or_else(|| {
                Some((
                    GangSource::Coscheduling,
                    label(COSCHEDULING_POD_GROUP_LABEL)?,
                ))
            })?;
        Some(GangKey {
            source,
            namespace,
            name,
        })
    }

    /// A label selector that narrows a list of the namespace's pods to the
    /// gang's (a superset: each listed pod is checked with [`GangKey::of`]);
    /// None where the mark is not a label.
    pub fn label_selector(&self, policy_label: Option<&str>) -> Option<String> {
        let key = match self.source {
            GangSource::PolicyLabel => policy_label?,
            GangSource::JobSet => JOBSET_NAME_LABEL,
            GangSource::Kueue => KUEUE_POD_GROUP_LABEL,
            GangSource::Coscheduling => COSCHEDULING_POD_GROUP_LABEL,
            // The group's name joins two labels: select on the first.
            GangSource::LeaderWorkerSet => LWS_NAME_LABEL,
            GangSource::PodGroup | GangSource::Volcano | GangSource::Kai => return None,
        };
        let value = match self.source {
            GangSource::LeaderWorkerSet => self.name.rsplit_once('-')?.0,
            _ => &self.name,
        };
        Some(format!("{key}={value}"))
    }
}

/// At most this many of a gang's nodes are recorded (its budget counts
/// those); `members` still counts every member.
pub const GANG_NODES_LIMIT: usize = 256;
/// At most this many gangs are recorded per incident.
pub const GANGS_LIMIT: usize = 8;

/// A gang whose members held the GPUs an incident acted on, as the incident
/// records it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GangRecord {
    #[serde(flatten)]
    pub gang: GangKey,
    pub mode: GangMode,
    /// Its members (pods not finished) when last counted.
    pub members: u32,
    /// The nodes they ran on: while the gang is being evicted, the
    /// policy's budget counts them as disrupted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 256))]
    pub nodes: Vec<String>,
    /// Under `Whole`: when every member was told it is evicted at.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evict_at: Option<Time>,
    /// When its members were deleted together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evicted_at: Option<Time>,
    /// Set when the gang was already restarting on its own (a member
    /// terminating that gpuhealth had not deleted): it is not evicted twice.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub restarted_on_its_own: bool,
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::core::v1::{PodSchedulingGroup, PodSpec};

    use super::*;

    fn pod(labels: &[(&str, &str)], annotations: &[(&str, &str)]) -> Pod {
        let map = |kv: &[(&str, &str)]| {
            Some(
                kv.iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect::<BTreeMap<_, _>>(),
            )
        };
        let mut p = Pod::default();
        p.metadata.namespace = Some("ml".into());
        p.metadata.name = Some("rank-0".into());
        p.metadata.labels = map(labels);
        p.metadata.annotations = map(annotations);
        p
    }

    fn gang(source: GangSource, name: &str) -> GangKey {
        GangKey {
            source,
            namespace: "ml".into(),
            name: name.into(),
        }
    }

    fn key(source: GangSource, name: &str) -> Option<GangKey> {
        Some(gang(source, name))
    }

    #[test]
    fn each_mark_names_its_gang() {
        let of = |p: &Pod| GangKey::of(p, None);
        assert_eq!(of(&pod(&[], &[])), None);
        assert_eq!(
            of(&pod(&[(JOBSET_NAME_LABEL, "train")], &[])),
            key(GangSource::JobSet, "train")
        );
        assert_eq!(
            of(&pod(
                &[(LWS_NAME_LABEL, "vllm"), (LWS_GROUP_INDEX_LABEL, "2")],
                &[]
            )),
            key(GangSource::LeaderWorkerSet, "vllm-2")
        );
        assert_eq!(
            of(&pod(&[(LWS_NAME_LABEL, "vllm")], &[])),
            None,
            "an LWS pod without its group index names no group"
        );
        assert_eq!(
            of(&pod(&[(KUEUE_POD_GROUP_LABEL, "g")], &[])),
            key(GangSource::Kueue, "g")
        );
        assert_eq!(
            of(&pod(&[], &[(VOLCANO_GROUP_ANNOTATION, "pg")])),
            key(GangSource::Volcano, "pg")
        );
        assert_eq!(
            of(&pod(&[], &[(KAI_POD_GROUP_ANNOTATION, "pg")])),
            key(GangSource::Kai, "pg")
        );
        assert_eq!(
            of(&pod(&[(COSCHEDULING_POD_GROUP_LABEL, "pg")], &[])),
            key(GangSource::Coscheduling, "pg")
        );
        assert_eq!(of(&pod(&[(JOBSET_NAME_LABEL, "")], &[])), None);
    }

    #[test]
    fn the_policys_label_and_the_pod_group_field_come_first() {
        let mut p = pod(&[(JOBSET_NAME_LABEL, "train"), ("team/gang", "g7")], &[]);
        assert_eq!(
            GangKey::of(&p, Some("team/gang")),
            key(GangSource::PolicyLabel, "g7")
        );
        p.spec = Some(PodSpec {
            scheduling_group: Some(PodSchedulingGroup {
                pod_group_name: Some("train-pg".into()),
            }),
            ..Default::default()
        });
        assert_eq!(GangKey::of(&p, None), key(GangSource::PodGroup, "train-pg"));
        assert_eq!(
            GangKey::of(&p, Some("absent/label")),
            key(GangSource::PodGroup, "train-pg")
        );
    }

    #[test]
    fn selectors_narrow_to_the_mark() {
        let lws = gang(GangSource::LeaderWorkerSet, "vllm-prod-2");
        assert_eq!(
            lws.label_selector(None).as_deref(),
            Some("leaderworkerset.sigs.k8s.io/name=vllm-prod")
        );
        let own = gang(GangSource::PolicyLabel, "g7");
        assert_eq!(
            own.label_selector(Some("team/gang")).as_deref(),
            Some("team/gang=g7")
        );
        assert_eq!(gang(GangSource::Volcano, "pg").label_selector(None), None);
        assert_eq!(
            gang(GangSource::JobSet, "train").to_string(),
            "JobSet ml/train"
        );
    }
}
