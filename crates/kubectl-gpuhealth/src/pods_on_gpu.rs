//! `kubectl gpuhealth pods-on-gpu NODE GPU`: which pods hold a GPU, from the
//! agent's report on the Node. It replaces the runbook's loop over
//! `crictl inspect` on the node. A pod the report names that is no longer
//! on the node (the report lags its leaving) is never shown as a holder.
//! Each holder shows its gang and whether gpuhealth has told it when the
//! gang leaves: the report names pods, only the Pods say that.

use gpuhealth_api::{
    contract::{GpuEntry, GpuReport, PodRef},
    gang::{EVICT_AT_ANNOTATION, GangKey},
};
use k8s_openapi::{api::core::v1::Pod, apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use kube::ResourceExt;
use serde::Serialize;

use crate::output::{Paint, Style, ago, rfc3339, table};

/// A GPU named by UUID, NVML index or PCI bus id (`0000:e1:00` as the kernel
/// log writes it, or `00000000:E1:00.0` as nvidia-smi does).
pub fn find<'a>(report: &'a GpuReport, gpu: &str) -> Result<&'a GpuEntry, String> {
    let wanted = gpu.trim();
    let by_uuid = report
        .gpus
        .iter()
        .find(|g| g.uuid.eq_ignore_ascii_case(wanted));
    let by_index = wanted
        .parse::<u32>()
        .ok()
        .and_then(|i| report.gpus.iter().find(|g| g.index == i));
    let by_pci =
        pci(wanted).and_then(|p| report.gpus.iter().find(|g| pci(&g.pci_bus_id) == Some(p)));
    by_uuid.or(by_index).or(by_pci).ok_or_else(|| {
        let known: Vec<String> = report
            .gpus
            .iter()
            .map(|g| format!("{} {} {}", g.index, g.uuid, g.pci_bus_id))
            .collect();
        format!(
            "no GPU {wanted:?} in the report; it has:\n  {}",
            known.join("\n  ")
        )
    })
}

/// Domain, bus and device of a PCI address, whatever its spelling.
fn pci(s: &str) -> Option<(u32, u32, u32)> {
    let s = s.strip_prefix("PCI:").unwrap_or(s);
    let mut parts = s.split(':');
    let (d, b, rest) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let dev = rest.split('.').next()?;
    let hex = |x: &str| u32::from_str_radix(x, 16).ok();
    Some((hex(d)?, hex(b)?, hex(dev)?))
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Answer<'a> {
    pub node: &'a str,
    /// The GPU as reported, less the holders that are gone.
    pub gpu: GpuEntry,
    /// `gpu.pods`, in order, with what their Pods say.
    pub holders: Vec<Holder>,
    /// Pods the report names that are no longer on the node.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub gone: Vec<PodRef>,
}

/// A pod holding the GPU, with its gang as gpuhealth reads it.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Holder {
    #[serde(flatten)]
    pub pod: PodRef,
    /// The gang it is one of ([`GangKey::of`]), if any.
    pub gang: Option<GangKey>,
    /// When its gang is evicted together (`gpuhealth.io/evict-at`): set
    /// once gpuhealth has told it.
    pub evict_at: Option<Time>,
}

impl<'a> Answer<'a> {
    /// `on_node`: every pod now on the node. `gang_label`: the node's
    /// policy's `drain.gangs.labelKey`, where known, so that the gang named
    /// is the one a drain acts on.
    pub fn new(
        node: &'a str,
        gpu: &GpuEntry,
        on_node: &[Pod],
        gang_label: Option<&str>,
    ) -> Answer<'a> {
        let mut gpu = gpu.clone();
        let pod_of = |p: &PodRef| {
            on_node.iter().find(|o| {
                o.metadata.namespace.as_deref() == Some(p.namespace.as_str())
                    && o.metadata.name.as_deref() == Some(p.name.as_str())
            })
        };
        let (here, gone): (Vec<PodRef>, Vec<PodRef>) =
            gpu.pods.into_iter().partition(|p| pod_of(p).is_some());
        let holders = here
            .iter()
            .filter_map(|p| {
                let pod = pod_of(p)?;
                Some(Holder {
                    pod: p.clone(),
                    gang: GangKey::of(pod, gang_label),
                    // Read as the operator reads it: a value that does not
                    // parse is no notice, and the operator tells it again.
                    evict_at: pod
                        .annotations()
                        .get(EVICT_AT_ANNOTATION)
                        .and_then(|v| v.parse::<Timestamp>().ok())
                        .map(Time),
                })
            })
            .collect();
        gpu.pods = here;
        Answer {
            node,
            gpu,
            holders,
            gone,
        }
    }
}

/// The answer as a person reads it. `now` only turns a gang's notice into
/// a countdown.
pub fn text(answer: &Answer<'_>, now: Timestamp, style: Style) -> String {
    let (node, gpu) = (answer.node, &answer.gpu);
    let mut out = format!(
        "GPU {} {} ({}) on {node}: {:?}\n",
        gpu.index, gpu.uuid, gpu.pci_bus_id, gpu.health
    );
    if let Some(why) = &gpu.pods_unknown {
        out.push_str(&format!("  who holds it is not fully known: {why}\n"));
    } else if answer.holders.is_empty() {
        out.push_str("  no pod holds it\n");
    }
    if !answer.holders.is_empty() {
        let plain = |s: String| (s, Paint::Plain);
        let rows: Vec<Vec<(String, Paint)>> = answer
            .holders
            .iter()
            .map(|h| {
                let container = h
                    .pod
                    .container
                    .as_deref()
                    .map(|c| format!(" (container {c})"))
                    .unwrap_or_default();
                vec![
                    plain(format!("{}/{}{container}", h.pod.namespace, h.pod.name)),
                    plain(
                        h.gang
                            .as_ref()
                            .map_or_else(|| "-".into(), ToString::to_string),
                    ),
                    match &h.evict_at {
                        Some(t) => (
                            format!("{} ({})", rfc3339(t.0), ago(now, t.0)),
                            Paint::Yellow,
                        ),
                        None => plain("-".into()),
                    },
                ]
            })
            .collect();
        out.push_str(&table(style, "  ", &["POD", "GANG", "EVICT-AT"], &rows));
    }
    for p in &answer.gone {
        out.push_str(&format!(
            "  ({}/{} is named by the report but no longer on the node)\n",
            p.namespace, p.name
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use gpuhealth_api::{contract::AnnotationValue, gang::JOBSET_NAME_LABEL};

    use super::*;

    const INCIDENT: &str =
        include_str!("../../gpuhealth-api/tests/fixtures/incident-gpu-report.json");

    #[test]
    fn a_gpu_is_found_by_uuid_index_or_either_pci_spelling() {
        let report = GpuReport::parse(INCIDENT).expect("fixture");
        let gpu7 = report.gpus.iter().find(|g| g.index == 7).expect("GPU 7");
        for name in [
            gpu7.uuid.as_str(),
            &gpu7.uuid.to_lowercase(),
            "7",
            "0000:e1:00",
            "00000000:E1:00.0",
            "PCI:0000:e1:00",
        ] {
            assert_eq!(find(&report, name).map(|g| g.index), Ok(7), "{name}");
        }
        let e = find(&report, "GPU-nope").expect_err("unknown");
        assert!(e.contains(&gpu7.uuid), "the error lists the GPUs: {e}");
    }

    const NOW: &str = "2026-05-29T08:16:00Z";

    fn t(s: &str) -> Timestamp {
        s.parse().expect("timestamp")
    }

    /// A Pod on the node for `p`, with `labels` and `annotations`.
    fn pod(p: &PodRef, labels: &[(&str, &str)], annotations: &[(&str, &str)]) -> Pod {
        let map = |kv: &[(&str, &str)]| {
            (!kv.is_empty()).then(|| {
                kv.iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect()
            })
        };
        let mut pod = Pod::default();
        pod.metadata.namespace = Some(p.namespace.clone());
        pod.metadata.name = Some(p.name.clone());
        pod.metadata.labels = map(labels);
        pod.metadata.annotations = map(annotations);
        pod
    }

    fn on_node(gpu: &GpuEntry) -> Vec<Pod> {
        gpu.pods.iter().map(|p| pod(p, &[], &[])).collect()
    }

    #[test]
    fn the_text_names_each_pod_and_container() {
        let report = GpuReport::parse(INCIDENT).expect("fixture");
        let gpu7 = find(&report, "7").expect("GPU 7");
        let answer = Answer::new("192.168.1.1", gpu7, &on_node(gpu7), None);
        let out = text(&answer, t(NOW), Style::default());
        assert!(out.starts_with("GPU 7 "), "{out}");
        assert!(
            out.contains("  ml-serving/vllm-0 (container vllm)  -     -\n"),
            "no gang, not told:\n{out}"
        );
        for p in &gpu7.pods {
            assert!(
                out.contains(&format!("{}/{}", p.namespace, p.name)),
                "{out}"
            );
        }
    }

    /// Three holders: a JobSet rank told its gang leaves at 08:16:45, a pod
    /// the policy's own label puts in a gang (over its JobSet label), and
    /// a pod of no gang.
    fn gang_holders() -> (GpuEntry, Vec<Pod>) {
        let report = GpuReport::parse(INCIDENT).expect("fixture");
        let mut gpu = find(&report, "7").expect("GPU 7").clone();
        let rank = PodRef {
            namespace: "ml".into(),
            name: "train-0".into(),
            container: Some("trainer".into()),
        };
        let labelled = PodRef {
            namespace: "ml".into(),
            name: "sweep-3".into(),
            container: None,
        };
        let pods = vec![
            pod(
                &rank,
                &[(JOBSET_NAME_LABEL, "train")],
                &[(EVICT_AT_ANNOTATION, "2026-05-29T08:16:45Z")],
            ),
            pod(
                &labelled,
                &[(JOBSET_NAME_LABEL, "sweep"), ("team/gang", "g7")],
                &[],
            ),
            pod(&gpu.pods[0], &[], &[]),
        ];
        gpu.pods.splice(0..0, [rank, labelled]);
        (gpu, pods)
    }

    #[test]
    fn each_holder_names_its_gang_and_when_the_gang_leaves() {
        let (gpu, pods) = gang_holders();
        let answer = Answer::new("192.168.1.1", &gpu, &pods, Some("team/gang"));
        let out = text(&answer, t(NOW), Style::default());
        let table = [
            "  POD                                 GANG               EVICT-AT",
            "  ml/train-0 (container trainer)      JobSet ml/train    2026-05-29T08:16:45Z (in 45s)",
            "  ml/sweep-3                          PolicyLabel ml/g7  -",
            "  ml-serving/vllm-0 (container vllm)  -                  -",
        ]
        .join("\n");
        assert!(out.contains(&table), "missing\n{table}\nin:\n{out}");
        // Without the policy's label the JobSet's mark names the gang.
        let answer = Answer::new("192.168.1.1", &gpu, &pods, None);
        assert_eq!(
            answer.holders[1].gang.as_ref().map(ToString::to_string),
            Some("JobSet ml/sweep".into())
        );
        let v = serde_json::to_value(&answer).expect("json");
        assert_eq!(v["holders"][0]["name"], "train-0");
        assert_eq!(v["holders"][0]["gang"]["source"], "JobSet");
        assert_eq!(v["holders"][0]["evictAt"], "2026-05-29T08:16:45Z");
        assert!(v["holders"][2]["gang"].is_null(), "{v}");
        assert_eq!(v["gpu"]["pods"][0]["name"], "train-0", "as reported");
    }

    #[test]
    fn a_notice_the_operator_cannot_read_is_no_notice() {
        let (gpu, mut pods) = gang_holders();
        pods[0].metadata.annotations = Some(
            [(EVICT_AT_ANNOTATION.to_owned(), "soon".to_owned())]
                .into_iter()
                .collect(),
        );
        let answer = Answer::new("192.168.1.1", &gpu, &pods, None);
        assert_eq!(answer.holders[0].evict_at, None);
        assert!(answer.holders[0].gang.is_some());
    }

    #[test]
    fn a_pod_no_longer_on_the_node_is_no_holder() {
        let report = GpuReport::parse(INCIDENT).expect("fixture");
        let gpu7 = find(&report, "7").expect("GPU 7");
        let answer = Answer::new("192.168.1.1", gpu7, &[], None);
        assert!(answer.gpu.pods.is_empty());
        assert!(answer.holders.is_empty());
        assert_eq!(answer.gone, gpu7.pods);
        let out = text(&answer, t(NOW), Style::default());
        assert!(out.contains("no pod holds it"), "{out}");
        assert!(!out.contains("GANG"), "no table without holders:\n{out}");
        assert!(out.contains("no longer on the node"), "{out}");
        let mut unknown = gpu7.clone();
        unknown.pods_unknown = Some("the kubelet's PodResources: connection refused".into());
        let answer = Answer::new("192.168.1.1", &unknown, &on_node(gpu7), None);
        let out = text(&answer, t(NOW), Style::default());
        assert!(out.contains("not fully known: the kubelet's"), "{out}");
    }
}
