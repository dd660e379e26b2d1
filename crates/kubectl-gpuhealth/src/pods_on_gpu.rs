//! `kubectl gpuhealth pods-on-gpu NODE GPU`: which pods hold a GPU, from the
//! agent's report on the Node. It replaces the runbook's loop over
//! `crictl inspect` on the node. A pod the report names that is no longer
//! on the node (the report lags its leaving) is never shown as a holder.

use gpuhealth_api::contract::{GpuEntry, GpuReport, PodRef};
use serde::Serialize;

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
    /// Pods the report names that are no longer on the node.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub gone: Vec<PodRef>,
}

impl<'a> Answer<'a> {
    /// `on_node`: the `namespace/name` of every pod now on the node.
    pub fn new(node: &'a str, gpu: &GpuEntry, on_node: &[String]) -> Answer<'a> {
        let mut gpu = gpu.clone();
        let (here, gone) = gpu
            .pods
            .into_iter()
            .partition(|p| on_node.contains(&format!("{}/{}", p.namespace, p.name)));
        gpu.pods = here;
        Answer { node, gpu, gone }
    }
}

/// The answer as a person reads it.
pub fn text(answer: &Answer<'_>) -> String {
    let (node, gpu) = (answer.node, &answer.gpu);
    let mut out = format!(
        "GPU {} {} ({}) on {node}: {:?}\n",
        gpu.index, gpu.uuid, gpu.pci_bus_id, gpu.health
    );
    if let Some(why) = &gpu.pods_unknown {
        out.push_str(&format!("  who holds it is not fully known: {why}\n"));
    } else if gpu.pods.is_empty() {
        out.push_str("  no pod holds it\n");
    }
    for p in &gpu.pods {
        let container = p
            .container
            .as_deref()
            .map(|c| format!(" (container {c})"))
            .unwrap_or_default();
        out.push_str(&format!("  {}/{}{container}\n", p.namespace, p.name));
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
    use gpuhealth_api::contract::AnnotationValue;

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

    fn on_node(gpu: &GpuEntry) -> Vec<String> {
        gpu.pods
            .iter()
            .map(|p| format!("{}/{}", p.namespace, p.name))
            .collect()
    }

    #[test]
    fn the_text_names_each_pod_and_container() {
        let report = GpuReport::parse(INCIDENT).expect("fixture");
        let gpu7 = find(&report, "7").expect("GPU 7");
        let out = text(&Answer::new("192.168.1.1", gpu7, &on_node(gpu7)));
        assert!(out.starts_with("GPU 7 "), "{out}");
        for p in &gpu7.pods {
            assert!(
                out.contains(&format!("{}/{}", p.namespace, p.name)),
                "{out}"
            );
        }
    }

    #[test]
    fn a_pod_no_longer_on_the_node_is_no_holder() {
        let report = GpuReport::parse(INCIDENT).expect("fixture");
        let gpu7 = find(&report, "7").expect("GPU 7");
        let answer = Answer::new("192.168.1.1", gpu7, &[]);
        assert!(answer.gpu.pods.is_empty());
        assert_eq!(answer.gone, gpu7.pods);
        let out = text(&answer);
        assert!(out.contains("no pod holds it"), "{out}");
        assert!(out.contains("no longer on the node"), "{out}");
        let mut unknown = gpu7.clone();
        unknown.pods_unknown = Some("the kubelet's PodResources: connection refused".into());
        let out = text(&Answer::new("192.168.1.1", &unknown, &on_node(gpu7)));
        assert!(out.contains("not fully known: the kubelet's"), "{out}");
    }
}
