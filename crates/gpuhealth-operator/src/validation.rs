//! The validation pod: the policy's template, pinned to the node under
//! verification.

use gpuhealth_api::policy::ValidationPod;
use gpuhealth_engine::machine::ValidationView;
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};

/// Marks the pods gpuhealth runs, and names the node each validates.
pub const VALIDATES_ANNOTATION: &str = "gpuhealth.io/validates";

/// Where the pod runs: the template's namespace, else the operator's.
pub fn namespace(template: &ValidationPod, operator_namespace: &str) -> String {
    template
        .template
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .unwrap_or(operator_namespace)
        .to_owned()
}

/// The pod for `node`, from the template: pinned by `spec.nodeName` (the
/// node is cordoned, so the scheduler would not place it), tolerating every
/// taint, and not restarted: one run is the verdict.
pub fn build(
    template: &ValidationPod,
    name: &str,
    namespace: &str,
    node: &str,
) -> Result<Pod, serde_json::Error> {
    let mut pod = template.template.clone();
    let Some(object) = pod.as_object_mut() else {
        return serde_json::from_value(pod);
    };
    object.insert("apiVersion".into(), json!("v1"));
    object.insert("kind".into(), json!("Pod"));
    let metadata = object.entry("metadata").or_insert_with(|| json!({}));
    if let Some(m) = metadata.as_object_mut() {
        m.insert("name".into(), json!(name));
        m.insert("namespace".into(), json!(namespace));
        m.remove("generateName");
        let labels = m.entry("labels").or_insert_with(|| json!({}));
        if let Some(l) = labels.as_object_mut() {
            l.insert("app.kubernetes.io/managed-by".into(), json!("gpuhealth"));
        }
        let annotations = m.entry("annotations").or_insert_with(|| json!({}));
        if let Some(a) = annotations.as_object_mut() {
            a.insert(VALIDATES_ANNOTATION.into(), json!(node));
        }
    }
    let spec = object.entry("spec").or_insert_with(|| json!({}));
    if let Some(s) = spec.as_object_mut() {
        s.insert("nodeName".into(), json!(node));
        s.entry("restartPolicy").or_insert_with(|| json!("Never"));
        let tolerations = s.entry("tolerations").or_insert_with(|| json!([]));
        if let Some(t) = tolerations.as_array_mut() {
            t.push(json!({"operator": "Exists"}));
        }
    }
    serde_json::from_value(pod)
}

/// The pod as the engine sees it.
pub fn view(pod: &Pod) -> ValidationView {
    let status = pod.status.as_ref();
    let phase = status
        .and_then(|s| s.phase.clone())
        .unwrap_or_else(|| "Pending".into());
    let terminated: Vec<String> = status
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .filter_map(|c| {
            let t = c.state.as_ref()?.terminated.as_ref()?;
            (t.exit_code != 0).then(|| {
                format!(
                    "container {} exited with code {}{}",
                    c.name,
                    t.exit_code,
                    t.reason
                        .as_deref()
                        .map(|r| format!(" ({r})"))
                        .unwrap_or_default()
                )
            })
        })
        .collect();
    let message = status
        .and_then(|s| s.message.clone())
        .into_iter()
        .chain(terminated)
        .collect::<Vec<_>>()
        .join("; ");
    ValidationView {
        phase,
        message: if message.is_empty() {
            "no reason given".into()
        } else {
            message
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(value: Value) -> ValidationPod {
        ValidationPod {
            template: value,
            timeout: gpuhealth_api::Duration::from_secs(60),
        }
    }

    #[test]
    fn the_pod_is_pinned_to_the_node_and_runs_once() {
        let t = template(json!({
            "metadata": {"labels": {"team": "ml"}},
            "spec": {"containers": [{"name": "dcgm", "image": "nvcr.io/nvidia/dcgm"}]},
        }));
        let pod = build(&t, "v-1", "gpuhealth-system", "node-a").expect("a pod");
        let spec = pod.spec.expect("spec");
        assert_eq!(spec.node_name.as_deref(), Some("node-a"));
        assert_eq!(spec.restart_policy.as_deref(), Some("Never"));
        assert!(
            spec.tolerations
                .unwrap_or_default()
                .iter()
                .any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none())
        );
        assert_eq!(pod.metadata.name.as_deref(), Some("v-1"));
        assert_eq!(pod.metadata.namespace.as_deref(), Some("gpuhealth-system"));
        let labels = pod.metadata.labels.unwrap_or_default();
        assert_eq!(labels.get("team").map(String::as_str), Some("ml"));
        assert_eq!(
            pod.metadata
                .annotations
                .unwrap_or_default()
                .get(VALIDATES_ANNOTATION)
                .map(String::as_str),
            Some("node-a")
        );
    }

    #[test]
    fn the_template_namespace_wins() {
        let t = template(json!({"metadata": {"namespace": "diag"}, "spec": {}}));
        assert_eq!(namespace(&t, "gpuhealth-system"), "diag");
        let t = template(json!({"spec": {}}));
        assert_eq!(namespace(&t, "gpuhealth-system"), "gpuhealth-system");
    }

    #[test]
    fn a_template_of_the_wrong_shape_is_an_error_not_a_panic() {
        let t = template(json!({"spec": {"containers": "not a list"}}));
        assert!(build(&t, "v", "ns", "node").is_err());
    }
}
