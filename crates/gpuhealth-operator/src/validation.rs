//! The validation pod: the policy's template, pinned to the node under
//! verification.

use gpuhealth_api::policy::ValidationPod;
use gpuhealth_engine::{honour::Problem, machine::ValidationView};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};

/// Marks the pods gpuhealth runs, and names the node each validates.
pub const VALIDATES_ANNOTATION: &str = "gpuhealth.io/validates";

/// Where validation pods run and as whom: a namespace of their own that
/// enforces `restricted` Pod Security, under a ServiceAccount with no
/// token and no permissions (`config/validation`).
#[derive(Clone, Debug)]
pub struct Target {
    pub namespace: String,
    pub service_account: String,
}

/// What a template may not ask for, by field: the pod would run as root
/// on the node, see GPUs it was not allocated, or run as someone other
/// than the validation ServiceAccount (or with a token of its).
/// The CRD refuses these too; this covers policies stored before it did.
pub fn refused_fields(template: &Value) -> Vec<String> {
    let mut refused = Vec::new();
    let set = |v: Option<&Value>| v.is_some_and(|v| !v.is_null());
    let yes = |v: Option<&Value>| v.and_then(Value::as_bool) == Some(true);
    if set(template.pointer("/metadata/namespace")) {
        refused.push("metadata.namespace".to_owned());
    }
    let Some(spec) = template.get("spec") else {
        return refused;
    };
    for field in ["hostNetwork", "hostPID", "hostIPC"] {
        if yes(spec.get(field)) {
            refused.push(format!("spec.{field}"));
        }
    }
    for field in ["serviceAccountName", "serviceAccount", "runtimeClassName"] {
        if set(spec.get(field)) {
            refused.push(format!("spec.{field}"));
        }
    }
    if yes(spec.get("automountServiceAccountToken")) {
        refused.push("spec.automountServiceAccountToken".to_owned());
    }
    let items = |key: &str| {
        spec.get(key)
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    for (i, volume) in items("volumes").iter().enumerate() {
        if set(volume.get("hostPath")) {
            refused.push(format!("spec.volumes[{i}].hostPath"));
        }
        let sources = volume
            .pointer("/projected/sources")
            .and_then(Value::as_array);
        for (j, source) in sources.into_iter().flatten().enumerate() {
            if set(source.get("serviceAccountToken")) {
                refused.push(format!(
                    "spec.volumes[{i}].projected.sources[{j}].serviceAccountToken"
                ));
            }
        }
    }
    for list in ["initContainers", "containers", "ephemeralContainers"] {
        for (i, c) in items(list).iter().enumerate() {
            let at = format!("spec.{list}[{i}]");
            let context = c.get("securityContext");
            let context = |f: &str| context.and_then(|c| c.get(f));
            if yes(context("privileged")) {
                refused.push(format!("{at}.securityContext.privileged"));
            }
            if yes(context("allowPrivilegeEscalation")) {
                refused.push(format!("{at}.securityContext.allowPrivilegeEscalation"));
            }
            let added = context("capabilities").and_then(|c| c.get("add"));
            if added
                .and_then(Value::as_array)
                .is_some_and(|a| !a.is_empty())
            {
                refused.push(format!("{at}.securityContext.capabilities.add"));
            }
            let env = c.get("env").and_then(Value::as_array);
            for (j, var) in env.into_iter().flatten().enumerate() {
                if var.get("name").and_then(Value::as_str) == Some("NVIDIA_VISIBLE_DEVICES") {
                    refused.push(format!("{at}.env[{j}].name"));
                }
            }
            let ports = c.get("ports").and_then(Value::as_array);
            for (j, port) in ports.into_iter().flatten().enumerate() {
                if port
                    .get("hostPort")
                    .and_then(Value::as_i64)
                    .is_some_and(|p| p != 0)
                {
                    refused.push(format!("{at}.ports[{j}].hostPort"));
                }
            }
        }
    }
    refused
}

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error(
        "the template sets {}: validation pods run in gpuhealth's validation namespace under its ServiceAccount, with no host access or privilege",
        .0.join(", ")
    )]
    Refused(Vec<String>),
    #[error("{0}")]
    Shape(#[from] serde_json::Error),
}

/// The pod for `node`, from the template: pinned by `spec.nodeName` (the
/// node is cordoned, so the scheduler would not place it), tolerating every
/// taint, not restarted (one run is the verdict), and meeting `restricted`
/// Pod Security where the template says nothing: no token, no privilege
/// escalation, no capabilities, the runtime's seccomp profile, not root.
pub fn build(
    template: &ValidationPod,
    name: &str,
    target: &Target,
    node: &str,
) -> Result<Pod, TemplateError> {
    let refused = refused_fields(&template.template);
    if !refused.is_empty() {
        return Err(TemplateError::Refused(refused));
    }
    let mut pod = template.template.clone();
    let Some(object) = pod.as_object_mut() else {
        return Ok(serde_json::from_value(pod)?);
    };
    object.insert("apiVersion".into(), json!("v1"));
    object.insert("kind".into(), json!("Pod"));
    let metadata = object.entry("metadata").or_insert_with(|| json!({}));
    if let Some(m) = metadata.as_object_mut() {
        m.insert("name".into(), json!(name));
        m.insert("namespace".into(), json!(target.namespace));
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
        s.insert("serviceAccountName".into(), json!(target.service_account));
        s.insert("automountServiceAccountToken".into(), json!(false));
        s.entry("restartPolicy").or_insert_with(|| json!("Never"));
        let tolerations = s.entry("tolerations").or_insert_with(|| json!([]));
        if let Some(t) = tolerations.as_array_mut() {
            t.push(json!({"operator": "Exists"}));
        }
        let context = s.entry("securityContext").or_insert_with(|| json!({}));
        if let Some(c) = context.as_object_mut() {
            c.entry("runAsNonRoot").or_insert(json!(true));
            c.entry("seccompProfile")
                .or_insert(json!({"type": "RuntimeDefault"}));
        }
        for list in ["initContainers", "containers"] {
            let containers = s.get_mut(list).and_then(Value::as_array_mut);
            for c in containers
                .into_iter()
                .flatten()
                .filter_map(Value::as_object_mut)
            {
                let context = c.entry("securityContext").or_insert_with(|| json!({}));
                if let Some(c) = context.as_object_mut() {
                    c.entry("allowPrivilegeEscalation").or_insert(json!(false));
                    c.entry("capabilities").or_insert(json!({"drop": ["ALL"]}));
                }
            }
        }
    }
    Ok(serde_json::from_value(pod)?)
}

/// Why no validation pod can be made from the policy's template, if none
/// can: a problem of the policy, for its `Ready` condition, found before a
/// node needs the pod.
pub fn template_problem(template: &ValidationPod, target: &Target) -> Option<Problem> {
    let why = match build(template, "check", target, "node").err()? {
        e @ TemplateError::Refused(_) => e.to_string(),
        TemplateError::Shape(e) => format!("not a pod template ({e})"),
    };
    Some(Problem::new(
        "spec.verification.validationPod.template",
        format!("{why}, so every validation pod is refused and verification fails at its timeout"),
    ))
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
        let pod = build(&t, "v-1", &target(), "node-a").expect("a pod");
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
        assert_eq!(
            pod.metadata.namespace.as_deref(),
            Some("gpuhealth-validation")
        );
        assert_eq!(
            spec.service_account_name.as_deref(),
            Some("gpuhealth-validation")
        );
        assert_eq!(spec.automount_service_account_token, Some(false));
        let context = spec.security_context.expect("pod security context");
        assert_eq!(context.run_as_non_root, Some(true));
        let container = spec.containers[0]
            .security_context
            .clone()
            .expect("context");
        assert_eq!(container.allow_privilege_escalation, Some(false));
        assert_eq!(
            container.capabilities.and_then(|c| c.drop),
            Some(vec!["ALL".to_owned()])
        );
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

    fn target() -> Target {
        Target {
            namespace: "gpuhealth-validation".into(),
            service_account: "gpuhealth-validation".into(),
        }
    }

    #[test]
    fn every_privileged_field_is_refused_by_name() {
        let t = template(json!({
            "metadata": {"namespace": "gpuhealth-system"},
            "spec": {
                "hostNetwork": true, "hostPID": true, "hostIPC": true,
                "serviceAccountName": "gpuhealth-agent", "automountServiceAccountToken": true,
                "runtimeClassName": "nvidia",
                "volumes": [
                    {"name": "ok", "emptyDir": {}},
                    {"name": "root", "hostPath": {"path": "/"}},
                    {"name": "token", "projected": {"sources": [
                        {"configMap": {"name": "ca"}},
                        {"serviceAccountToken": {"path": "token"}},
                    ]}},
                ],
                "initContainers": [{"name": "i", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}],
                "containers": [{
                    "name": "c",
                    "securityContext": {"privileged": true, "allowPrivilegeEscalation": true},
                    "env": [{"name": "MODEL", "value": "x"}, {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}],
                    "ports": [{"containerPort": 80, "hostPort": 80}],
                }],
            },
        }));
        let Err(TemplateError::Refused(fields)) = build(&t, "v", &target(), "node") else {
            panic!("refused");
        };
        assert_eq!(
            fields,
            [
                "metadata.namespace",
                "spec.hostNetwork",
                "spec.hostPID",
                "spec.hostIPC",
                "spec.serviceAccountName",
                "spec.runtimeClassName",
                "spec.automountServiceAccountToken",
                "spec.volumes[1].hostPath",
                "spec.volumes[2].projected.sources[1].serviceAccountToken",
                "spec.initContainers[0].securityContext.capabilities.add",
                "spec.containers[0].securityContext.privileged",
                "spec.containers[0].securityContext.allowPrivilegeEscalation",
                "spec.containers[0].env[1].name",
                "spec.containers[0].ports[0].hostPort",
            ]
        );
        let message = build(&t, "v", &target(), "node")
            .expect_err("refused")
            .to_string();
        assert!(message.contains("spec.hostPID"), "{message}");
    }

    #[test]
    fn what_the_template_says_of_itself_within_restricted_is_kept() {
        let t = template(json!({"spec": {
            "securityContext": {"runAsUser": 1000, "runAsNonRoot": true},
            "containers": [{"name": "c", "securityContext": {"capabilities": {"drop": ["ALL"], "add": []}}}],
        }}));
        let pod = build(&t, "v", &target(), "node").expect("a pod");
        let spec = pod.spec.expect("spec");
        assert_eq!(
            spec.security_context.and_then(|c| c.run_as_user),
            Some(1000)
        );
    }

    #[test]
    fn a_template_of_the_wrong_shape_is_an_error_not_a_panic() {
        let t = template(json!({"spec": {"containers": "not a list"}}));
        assert!(build(&t, "v", &target(), "node").is_err());
    }

    #[test]
    fn a_template_no_pod_can_be_made_from_is_a_problem_of_the_policy() {
        let field = "spec.verification.validationPod.template";
        // The schema leaves a container's fields but two to the pod.
        let numbered = template(json!({"spec": {"containers": [{"name": 7}]}}));
        let problem = template_problem(&numbered, &target()).expect("a problem");
        assert_eq!(problem.field, field);
        assert!(
            problem
                .message
                .starts_with("not a pod template (invalid type: integer `7`"),
            "{}",
            problem.message
        );
        assert!(
            problem
                .message
                .ends_with("verification fails at its timeout")
        );
        let privileged =
            template(json!({"spec": {"hostPID": true, "containers": [{"name": "c"}]}}));
        let problem = template_problem(&privileged, &target()).expect("a problem");
        assert!(
            problem
                .message
                .starts_with("the template sets spec.hostPID"),
            "{}",
            problem.message
        );
        let fine = template(json!({"spec": {"containers": [{"name": "c", "image": "dcgm"}]}}));
        assert_eq!(template_problem(&fine, &target()), None);
    }
}
