//! Reading the workloads the engine watches after a recovery: their pods
//! wherever they run, the kubelet's Events about each, and the Xids of the
//! GPUs each holds (from its node's report).

use std::collections::BTreeMap;

use gpuhealth_api::contract::{AnnotationValue, GPU_REPORT_ANNOTATION, GpuReport, XidEvent};
use gpuhealth_engine::workload::{WorkloadView, controller_of, observe};
use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::{Api, ResourceExt, api::ListParams, runtime::reflector::ObjectRef};

use crate::context::Context;

/// The pods of each named workload (`Kind/namespace/name`), observed.
pub async fn watched(ctx: &Context, names: &[String]) -> Result<Vec<WorkloadView>, kube::Error> {
    let mut by_namespace: BTreeMap<&str, Vec<Pod>> = BTreeMap::new();
    // Each node's report, parsed once.
    let mut reports: BTreeMap<String, Option<GpuReport>> = BTreeMap::new();
    let mut views = Vec::new();
    for name in names {
        let Some(namespace) = name.split('/').nth(1) else {
            continue;
        };
        if !by_namespace.contains_key(namespace) {
            let api: Api<Pod> = Api::namespaced(ctx.client.clone(), namespace);
            let pods = api.list(&ListParams::default()).await?.items;
            by_namespace.insert(namespace, pods);
        }
        let mut pods = Vec::new();
        for pod in by_namespace[namespace]
            .iter()
            .filter(|p| controller_of(p).as_ref() == Some(name))
        {
            pods.push(observe(
                pod,
                &events_about(ctx, pod).await?,
                xids_of(ctx, &mut reports, pod),
            ));
        }
        views.push(WorkloadView {
            name: name.clone(),
            pods,
        });
    }
    Ok(views)
}

/// The Events about a pod (the kubelet's among them).
async fn events_about(ctx: &Context, pod: &Pod) -> Result<Vec<Event>, kube::Error> {
    let api: Api<Event> = Api::namespaced(ctx.client.clone(), &pod.namespace().unwrap_or_default());
    let fields = format!(
        "involvedObject.kind=Pod,involvedObject.name={}",
        pod.name_any()
    );
    Ok(api
        .list(&ListParams::default().fields(&fields))
        .await?
        .items)
}

/// The Xids of the GPUs a pod holds, from its node's report.
fn xids_of(
    ctx: &Context,
    reports: &mut BTreeMap<String, Option<GpuReport>>,
    pod: &Pod,
) -> Vec<XidEvent> {
    let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.clone()) else {
        return Vec::new();
    };
    let report = reports.entry(node).or_insert_with_key(|node| {
        let node = ctx.nodes.get(&ObjectRef::<Node>::new(node))?;
        GpuReport::parse(node.annotations().get(GPU_REPORT_ANNOTATION)?).ok()
    });
    report.as_ref().map_or_else(Vec::new, |r| {
        r.xids_of_pod(&pod.namespace().unwrap_or_default(), &pod.name_any())
    })
}
