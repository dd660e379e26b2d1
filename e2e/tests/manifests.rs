//! The agent's shipped overlays, built with `kubectl kustomize` as a user
//! would: each has what its way of reaching the driver needs, and what each
//! part's defaults need on a real GPU node, and no more.

use gpuhealth_e2e::{
    kubectl,
    shipped::{Part, shipped_container},
};
use k8s_openapi::api::{
    apps::v1::DaemonSet,
    core::v1::{Container, PodSpec},
};
use serde::Deserialize;

const OVERLAYS: [&str; 2] = ["container-toolkit", "driver-root"];

/// `part`'s DaemonSet in `config/agent/<overlay>`, and its container.
async fn daemonset(overlay: &str, part: Part) -> (PodSpec, Container) {
    let dir = format!("{}/../config/agent/{overlay}", env!("CARGO_MANIFEST_DIR"));
    let built = kubectl(&["kustomize", &dir]).await.expect("kustomize");
    let (name, _) = part.daemonset();
    let ds: DaemonSet = serde_yaml::Deserializer::from_str(&built)
        .map(|doc| serde_yaml::Value::deserialize(doc).expect("YAML"))
        .find(|v| {
            v.get("kind").and_then(|k| k.as_str()) == Some("DaemonSet")
                && v["metadata"]["name"].as_str() == Some(name)
        })
        .map(|v| serde_yaml::from_value(v).expect("a DaemonSet"))
        .unwrap_or_else(|| panic!("config/agent/{overlay} ships no DaemonSet {name}"));
    let pod = ds.spec.and_then(|s| s.template.spec).expect("pod spec");
    let container = shipped_container(overlay, part)
        .await
        .expect("the container");
    (pod, container)
}

fn env(c: &Container, name: &str) -> Option<String> {
    c.env
        .iter()
        .flatten()
        .find(|e| e.name == name)
        .and_then(|e| e.value.clone())
}

/// The host path mounted at `mount_path`, and whether read-only.
fn mounted(pod: &PodSpec, c: &Container, mount_path: &str) -> Option<(String, bool)> {
    let mount = c
        .volume_mounts
        .iter()
        .flatten()
        .find(|m| m.mount_path == mount_path)?;
    let volume = pod
        .volumes
        .iter()
        .flatten()
        .find(|v| v.name == mount.name)?;
    let host_path = volume.host_path.as_ref()?.path.clone();
    let host_path = match mount.sub_path.as_deref() {
        Some(sub) if !sub.is_empty() => format!("{}/{sub}", host_path.trim_end_matches('/')),
        _ => host_path,
    };
    Some((host_path, mount.read_only.unwrap_or(false)))
}

#[tokio::test]
async fn each_overlay_has_what_a_real_gpu_node_needs() {
    for overlay in OVERLAYS {
        for part in Part::BOTH {
            let (pod, c) = daemonset(overlay, part).await;
            let args = c.args.clone().unwrap_or_default();
            let at = |what: &str| format!("{overlay}, the {part:?}: {what}");
            assert!(
                args.contains(&format!("--role={}", part.role())),
                "{}",
                at("its role")
            );
            // NVML, the reading the shipped agent requires.
            assert!(
                args.contains(&"--backend=nvml".to_owned()),
                "{}",
                at("nvml")
            );
            // Probes on the port the agent serves them on (its default, 8080).
            let port = c
                .ports
                .iter()
                .flatten()
                .find(|p| p.name.as_deref() == Some("metrics"))
                .map(|p| p.container_port);
            assert_eq!(port, Some(8080), "{}", at("the metrics port"));
            for (probe, path) in [
                (&c.liveness_probe, "/livez"),
                (&c.readiness_probe, "/readyz"),
            ] {
                let get = probe.as_ref().and_then(|p| p.http_get.as_ref());
                assert_eq!(
                    get.and_then(|g| g.path.as_deref()),
                    Some(path),
                    "{}",
                    at(path)
                );
            }
            // No /dev/kmsg: a container that is not privileged cannot open
            // it (the kernel log comes through syslog(2)), and a privileged
            // one has the host's.
            assert_eq!(mounted(&pod, &c, "/dev/kmsg"), None, "{}", at("kmsg"));
            // Every toleration: it must run on a sick, cordoned, tainted node.
            assert!(
                pod.tolerations
                    .iter()
                    .flatten()
                    .any(|t| t.operator.as_deref() == Some("Exists") && t.key.is_none()),
                "{}",
                at("tolerations")
            );
            let security = c.security_context.clone().unwrap_or_default();
            let bus = mounted(&pod, &c, "/run/dbus").map(|m| m.0);
            match part {
                // The kubelet's PodResources; its own state, and the
                // executor's read-only; no host processes, no bus.
                Part::Reporter => {
                    assert_eq!(pod.host_pid, None, "{}", at("hostPID"));
                    assert_eq!(
                        mounted(&pod, &c, "/var/lib/kubelet/pod-resources"),
                        Some(("/var/lib/kubelet/pod-resources".into(), true)),
                        "{}",
                        at("PodResources")
                    );
                    assert_eq!(
                        mounted(&pod, &c, "/var/lib/gpuhealth-reporter"),
                        Some(("/var/lib/gpuhealth-reporter".into(), false)),
                        "{}",
                        at("its state")
                    );
                    assert_eq!(
                        env(&c, "GPUHEALTH_STATE_DIR").as_deref(),
                        Some("/var/lib/gpuhealth-reporter")
                    );
                    assert_eq!(
                        mounted(&pod, &c, "/var/lib/gpuhealth-agent"),
                        Some(("/var/lib/gpuhealth-agent".into(), true)),
                        "{}",
                        at("the executor's state, read-only")
                    );
                    assert_eq!(
                        env(&c, "GPUHEALTH_EXECUTOR_STATE_DIR").as_deref(),
                        Some("/var/lib/gpuhealth-agent")
                    );
                    assert_eq!(bus, None, "{}", at("no system bus"));
                    // The runtime's confinement: nothing of the host's to read.
                    assert_eq!(
                        (&security.app_armor_profile, &security.se_linux_options),
                        (&None, &None),
                        "{}",
                        at("the runtime's AppArmor profile and SELinux type")
                    );
                }
                // The host's processes, to name a GPU's holders; the
                // journal that outlives the pod; reboots through logind.
                Part::Executor => {
                    assert_eq!(pod.host_pid, Some(true), "{}", at("hostPID"));
                    assert_eq!(
                        mounted(&pod, &c, "/var/lib/gpuhealth-agent"),
                        Some(("/var/lib/gpuhealth-agent".into(), false)),
                        "{}",
                        at("state")
                    );
                    assert_eq!(
                        mounted(&pod, &c, "/var/lib/kubelet/pod-resources"),
                        None,
                        "{}",
                        at("no PodResources")
                    );
                    assert!(
                        args.contains(&"--reboot-method=logind".to_owned()),
                        "{}",
                        at("logind")
                    );
                    // The directory, where the bus's socket is (re)created,
                    // and the socket's address in it, said explicitly.
                    assert_eq!(bus, Some("/run/dbus".into()), "{}", at("the system bus"));
                    assert_eq!(
                        env(&c, "DBUS_SYSTEM_BUS_ADDRESS").as_deref(),
                        Some("unix:path=/run/dbus/system_bus_socket"),
                        "{}",
                        at("the bus's address")
                    );
                    // Outside the runtime's default AppArmor profile and
                    // SELinux type, which keep the host's processes' open
                    // files and the bus out of reach.
                    assert_eq!(
                        security
                            .app_armor_profile
                            .as_ref()
                            .map(|p| p.type_.as_str()),
                        Some("Unconfined"),
                        "{}",
                        at("AppArmor")
                    );
                    assert_eq!(
                        security
                            .se_linux_options
                            .as_ref()
                            .and_then(|o| o.type_.as_deref()),
                        Some("spc_t"),
                        "{}",
                        at("SELinux")
                    );
                    let sys_boot = security
                        .capabilities
                        .and_then(|c| c.add)
                        .is_some_and(|a| a.iter().any(|c| c == "SYS_BOOT"));
                    assert!(
                        security.privileged == Some(true) || sys_boot,
                        "{}",
                        at("CAP_SYS_BOOT")
                    );
                }
            }
        }
    }
}

#[tokio::test]
async fn the_container_toolkit_overlay_asks_the_nvidia_runtime_for_nvml_and_nvidia_smi() {
    for part in Part::BOTH {
        let (pod, c) = daemonset("container-toolkit", part).await;
        assert_eq!(
            pod.runtime_class_name.as_deref(),
            Some("nvidia"),
            "{part:?}"
        );
        assert_eq!(env(&c, "NVIDIA_VISIBLE_DEVICES").as_deref(), Some("all"));
        // `utility` is the capability that injects libnvidia-ml.so.1 and nvidia-smi.
        let caps = env(&c, "NVIDIA_DRIVER_CAPABILITIES").unwrap_or_default();
        assert!(
            caps.split(',').any(|c| c == "utility" || c == "all"),
            "{part:?}: {caps}"
        );
    }
}

#[tokio::test]
async fn the_driver_root_overlay_mounts_the_driver_read_only_and_finds_it() {
    for part in Part::BOTH {
        let (pod, c) = daemonset("driver-root", part).await;
        assert_eq!(
            mounted(&pod, &c, "/driver-root"),
            Some(("/run/nvidia/driver".into(), true)),
            "{part:?}"
        );
        // The agent finds NVML and nvidia-smi in the root itself; the host's
        // libraries on LD_LIBRARY_PATH would load its libc beside the image's.
        assert_eq!(
            env(&c, "GPUHEALTH_DRIVER_ROOT").as_deref(),
            Some("/driver-root")
        );
        for inherited in [
            "LD_LIBRARY_PATH",
            "GPUHEALTH_NVIDIA_SMI",
            "GPUHEALTH_NVML_LIBRARY",
        ] {
            assert_eq!(env(&c, inherited), None, "{part:?}: {inherited}");
        }
        assert!(pod.runtime_class_name.is_none());
        // Without the NVIDIA runtime, the device nodes come from the host's
        // /dev, which only a privileged container may open.
        assert_eq!(
            c.security_context.and_then(|s| s.privileged),
            Some(true),
            "{part:?}"
        );
    }
    // nvidia-persistenced, which must let a GPU go before its reset, runs
    // in the driver container: its socket where the executor's nvidia-smi
    // asks for it.
    let (pod, c) = daemonset("driver-root", Part::Executor).await;
    assert_eq!(
        mounted(&pod, &c, "/run/nvidia-persistenced"),
        Some(("/run/nvidia/driver/run/nvidia-persistenced".into(), true))
    );
}

#[tokio::test]
async fn the_default_agent_is_not_privileged_and_adds_back_only_what_it_needs() {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/security.md"))
        .expect("docs/security.md");
    for (part, needs) in [
        (Part::Reporter, vec!["SYSLOG"]),
        (
            Part::Executor,
            vec!["DAC_READ_SEARCH", "SYS_ADMIN", "SYS_BOOT", "SYS_PTRACE"],
        ),
    ] {
        let (_, c) = daemonset("container-toolkit", part).await;
        let context = c.security_context.expect("a security context");
        assert_eq!(context.privileged, Some(false), "{part:?}");
        assert_eq!(context.allow_privilege_escalation, Some(false), "{part:?}");
        assert_eq!(context.read_only_root_filesystem, Some(true), "{part:?}");
        let capabilities = context.capabilities.expect("capabilities");
        assert_eq!(capabilities.drop, Some(vec!["ALL".to_owned()]));
        let mut added = capabilities.add.unwrap_or_default();
        added.sort();
        assert_eq!(added, needs, "{part:?}");
        // The table of what each is for.
        for c in &added {
            assert!(
                doc.contains(&format!("`CAP_{c}`")),
                "docs/security.md says what {c} is for"
            );
        }
    }
}

/// Every object `config/default` installs, as `kubectl kustomize` builds them.
async fn default_install() -> Vec<serde_json::Value> {
    let dir = format!("{}/../config/default", env!("CARGO_MANIFEST_DIR"));
    let built = kubectl(&["kustomize", &dir]).await.expect("kustomize");
    serde_yaml::Deserializer::from_str(&built)
        .map(|doc| serde_json::Value::deserialize(doc).expect("YAML"))
        .collect()
}

fn find<'a>(all: &'a [serde_json::Value], kind: &str, name: &str) -> &'a serde_json::Value {
    all.iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("config/default installs no {kind} {name}"))
}

#[tokio::test]
async fn the_default_install_holds_the_policies_and_a_restricted_place_for_validation_pods() {
    let all = default_install().await;
    // Those that guard what gpuhealth acts on also put each refusal in the
    // API server's audit log.
    for (policy, actions) in [
        (
            "gpuhealth-operator-keys",
            serde_json::json!(["Deny", "Audit"]),
        ),
        ("gpuhealth-agent-keys", serde_json::json!(["Deny", "Audit"])),
        (
            "gpuhealth-maintenance-notice",
            serde_json::json!(["Deny", "Audit"]),
        ),
        (
            "gpuhealth-trusted-conditions",
            serde_json::json!(["Deny", "Audit"]),
        ),
        ("gpuhealth-agent-own-node", serde_json::json!(["Deny"])),
    ] {
        find(&all, "ValidatingAdmissionPolicy", policy);
        let binding = find(&all, "ValidatingAdmissionPolicyBinding", policy);
        assert_eq!(binding["spec"]["policyName"], policy);
        assert_eq!(binding["spec"]["validationActions"], actions, "{policy}");
    }
    // Break glass is shipped, and bound to no one.
    find(&all, "ClusterRole", "gpuhealth-break-glass");
    assert!(
        !all.iter()
            .any(|o| o["roleRef"]["name"] == "gpuhealth-break-glass"),
        "the break-glass role is bound"
    );

    let namespace = find(&all, "Namespace", "gpuhealth-validation");
    assert_eq!(
        namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"],
        "restricted"
    );
    let account = find(&all, "ServiceAccount", "gpuhealth-validation");
    assert_eq!(account["automountServiceAccountToken"], false);
    assert!(
        !all.iter().any(|o| o["kind"] == "RoleBinding"
            && o["roleRef"]["name"].as_str().is_some()
            && o["subjects"][0]["name"] == "gpuhealth-validation"),
        "the validation ServiceAccount has no permissions"
    );
    // The operator may create pods there and nowhere else.
    let creators: Vec<String> = all
        .iter()
        .filter(|o| o["kind"] == "Role" || o["kind"] == "ClusterRole")
        .filter(|o| {
            o["rules"].as_array().into_iter().flatten().any(|r| {
                r["resources"]
                    .as_array()
                    .is_some_and(|rs| rs.iter().any(|x| x == "pods"))
                    && r["verbs"]
                        .as_array()
                        .is_some_and(|vs| vs.iter().any(|v| v == "create"))
            })
        })
        .map(|o| {
            let m = &o["metadata"];
            format!(
                "{}/{}",
                m["namespace"].as_str().unwrap_or(""),
                m["name"].as_str().unwrap_or("")
            )
        })
        .collect();
    assert_eq!(
        creators,
        ["gpuhealth-validation/gpuhealth-operator-validation"],
        "who may create pods"
    );
    let operator = find(&all, "Deployment", "gpuhealth-operator");
    let args = &operator["spec"]["template"]["spec"]["containers"][0]["args"];
    assert!(
        args.as_array().is_some_and(|a| a
            .iter()
            .any(|x| x == "--validation-namespace=gpuhealth-validation")),
        "{args}"
    );
}

/// The agent's admission policy, as shipped.
fn agent_policy() -> String {
    let path = format!(
        "{}/../config/agent/base/admission-policy.yaml",
        env!("CARGO_MANIFEST_DIR")
    );
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// The policy keeps every field of a Node's status but its conditions as it
/// was, and so does the one holding the operator to its `GpuHealthy`
/// condition (`agent-keys.yaml`). CEL cannot compare a typed status less
/// one field, so each policy names each: a field the API's NodeStatus
/// gains (a new Kubernetes minor) fails this test until both name it too.
/// The literal below names every field with no `..`, so that such a field
/// fails its build first.
#[test]
fn the_agent_policy_keeps_every_status_field_but_its_condition() {
    use k8s_openapi::api::core::v1::NodeStatus;
    let every = NodeStatus {
        addresses: Some(Vec::new()),
        allocatable: Some(Default::default()),
        capacity: Some(Default::default()),
        conditions: Some(Vec::new()),
        config: Some(Default::default()),
        daemon_endpoints: Some(Default::default()),
        declared_features: Some(Vec::new()),
        features: Some(Default::default()),
        images: Some(Vec::new()),
        node_info: Some(Default::default()),
        phase: Some(String::new()),
        runtime_handlers: Some(Vec::new()),
        volumes_attached: Some(Vec::new()),
        volumes_in_use: Some(Vec::new()),
    };
    let fields = serde_json::to_value(&every).expect("JSON");
    let keys = format!(
        "{}/../config/admission/agent-keys.yaml",
        env!("CARGO_MANIFEST_DIR")
    );
    let keys = std::fs::read_to_string(&keys).unwrap_or_else(|e| panic!("{keys}: {e}"));
    for (whose, policy) in [("the agent's", agent_policy()), ("the operator's", keys)] {
        let missing: Vec<&String> = fields
            .as_object()
            .expect("an object")
            .keys()
            .filter(|f| *f != "conditions")
            .filter(|f| !policy.contains(&format!("object.status.{f} == oldObject.status.{f}")))
            .collect();
        assert!(
            missing.is_empty(),
            "{whose} policy lets it change status fields {missing:?}"
        );
    }
}

/// The labels the agent may flip are exactly those it pauses by default:
/// never the driver's.
#[test]
fn the_agent_may_flip_only_the_operand_labels_it_pauses() {
    let policy = agent_policy();
    let start = policy
        .find("- name: operands")
        .expect("an operands variable");
    let listed = &policy[start..];
    let listed = &listed[listed.find('[').expect("[")..=listed.find(']').expect("]")];
    let labels: Vec<&str> = listed
        .split('\'')
        .filter(|s| s.starts_with("nvidia.com/"))
        .collect();
    assert_eq!(labels, gpuhealth_agent::operands::DEFAULT_OPERANDS);
    assert!(!labels.iter().any(|l| l.ends_with(".driver")));
}
