//! gpuhealth installed as a user installs it, on a real kubelet node
//! (`e2e/node/`), run by `make e2e-node`: the images `make images` built,
//! `config/default` applied with only its image references pointed at
//! them, the operator and the agent's two parts as real pods, each part
//! holding what the kernel shows and no more, a GPU workload pod on
//! each of the NVML stand-in's GPUs, NVIDIA's device plugin stand-in as
//! the GPU Operator's DaemonSet runs it, and nvidia-persistenced holding
//! the GPUs. Then the incident, end to end: Xid 119 and 154 on GPU 7, the
//! pod on it evicted by the real kubelet, the operands paused,
//! persistenced and the reporter letting go, `nvidia-smi` resetting inside
//! the executor's container, the GPU offered again, the node verified and uncordoned;
//! then a reset that fails, and the reboot it escalates to reaching logind
//! once through the shipped socket path.
//!
//! One test: the node is one per machine. Long because that one test is
//! the whole story a user's install lives through, told in order.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use gpuhealth_api::{
    GpuHealth, GpuNodeHealth,
    contract::{
        AnnotationValue, GPU_REPORT_ANNOTATION, GpuReport, Outcome, REQUEST_RESULT_ANNOTATION,
        RequestResult,
    },
    node_health::Phase,
    vocabulary::IncidentOutcome,
};
use gpuhealth_e2e::{
    client,
    host::{DEVICE_PLUGIN_LABEL, uuid},
    kubectl,
    process::capability_mask,
    real_node::{
        Confinement, DRIVER_ROOT, RealNode, confinement, container_process, shipped_images,
    },
    shipped::{Part, shipped_container},
    sim::{is_cordoned, pod_is_ready},
    wait::{WAIT, until, until_set},
};
use k8s_openapi::api::{
    apps::v1::{DaemonSet, Deployment},
    core::v1::{Container, Node, Pod, SecurityContext},
};
use kube::{Api, Client, ResourceExt, runtime::watcher};

const SYSTEM: &str = "gpuhealth-system";
const SERVING: &str = "ml-serving";

fn report(n: &Node) -> Option<GpuReport> {
    GpuReport::parse(n.annotations().get(GPU_REPORT_ANNOTATION)?).ok()
}

fn result(n: &Node) -> Option<RequestResult> {
    RequestResult::parse(n.annotations().get(REQUEST_RESULT_ANNOTATION)?).ok()
}

fn allocatable_gpus(n: &Node) -> Option<String> {
    let q = n
        .status
        .as_ref()?
        .allocatable
        .as_ref()?
        .get("nvidia.com/gpu")?;
    Some(q.0.clone())
}

async fn apply(yaml: &str) {
    let file =
        std::env::temp_dir().join(format!("gpuhealth-real-node-{}.yaml", std::process::id()));
    std::fs::write(&file, yaml).expect("a manifest");
    kubectl(&["apply", "--server-side", "-f", &file.display().to_string()])
        .await
        .expect("kubectl apply");
}

/// The pods of `namespace` on the node, by name, once `done` holds for them.
async fn pods_until(
    client: &Client,
    namespace: &str,
    what: &str,
    done: impl Fn(&[&Pod]) -> bool,
) -> Vec<Pod> {
    let api: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let set = until_set(api, watcher::Config::default(), what, WAIT, |pods| {
        done(&pods.values().collect::<Vec<_>>())
    })
    .await
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    set.into_values().collect()
}

fn running_ready(pods: &[&Pod]) -> usize {
    pods.iter()
        .filter(|p| p.metadata.deletion_timestamp.is_none() && pod_is_ready(p))
        .count()
}

/// config/default as shipped with the agent of `config/agent/<agent>`
/// (`container-toolkit`, as shipped; `driver-root` in its place, as the
/// README says for nodes without the NVIDIA runtime), its images pointed at
/// those `make images` built (by digest: exactly those), nothing else
/// changed.
fn install_overlay(agent: &str) -> PathBuf {
    let config = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config");
    let dir = config.join("../target/real-node-install").join(agent);
    std::fs::create_dir_all(&dir).expect("the overlay's directory");
    let default: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(config.join("default/kustomization.yaml"))
            .expect("config/default"),
    )
    .expect("config/default's kustomization");
    let mut resources = String::new();
    for r in default["resources"].as_sequence().expect("resources") {
        let r = r.as_str().expect("a resource's path");
        let r = if r == "../agent/container-toolkit" {
            format!("../agent/{agent}")
        } else {
            r.to_owned()
        };
        resources.push_str(&format!("  - ../../../config/default/{r}\n"));
    }
    let mut images = String::new();
    for (_, reference) in shipped_images().expect("make images") {
        let (name, digest) = reference.split_once('@').expect("name@digest");
        let name = name.rsplit_once(':').map_or(name, |(n, _)| n);
        images.push_str(&format!("  - name: {name}\n    digest: {digest}\n"));
    }
    std::fs::write(
        dir.join("kustomization.yaml"),
        format!(
            "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n{resources}images:\n{images}"
        ),
    )
    .expect("the overlay");
    dir
}

async fn install(agent: &str) {
    kubectl(&[
        "apply",
        "--server-side",
        "--force-conflicts",
        "-k",
        &install_overlay(agent).display().to_string(),
    ])
    .await
    .unwrap_or_else(|e| panic!("kubectl apply -k of config/default with {agent}: {e}"));
}

fn is_part(p: &Pod, part: Part) -> bool {
    p.labels().get("app.kubernetes.io/name").map(String::as_str) == Some(part.daemonset().0)
}

/// `part`'s pod Ready on the node, run as `config/agent/<overlay>` ships
/// it (flags, environment, security context, mounts, runtime class), once
/// no other pod of that part is left.
async fn agent_as_shipped(client: &Client, node: &str, overlay: &str, part: Part) -> Pod {
    let shipped = shipped_container(overlay, part).await.expect("shipped");
    let runtime_class = (overlay == "container-toolkit").then(|| "nvidia".to_owned());
    let what = format!("the {part:?}'s pod of {overlay}, alone and Ready on the real node");
    let api: Api<Pod> = Api::namespaced(client.clone(), SYSTEM);
    let pods = until_set(api, watcher::Config::default(), &what, WAIT, |pods| {
        let pods: Vec<&Pod> = pods.values().filter(|p| is_part(p, part)).collect();
        pods.len() == 1
            && pod_is_ready(pods[0])
            && pods[0].spec.as_ref().is_some_and(|s| {
                s.runtime_class_name == runtime_class
                    && security_context(&s.containers[0]) == security_context(&shipped)
            })
    })
    .await;
    let pods = match pods {
        Ok(pods) => pods.into_values(),
        Err(e) => {
            // What the kubelet and the agent say, since CI keeps no logs.
            let selector = format!("app.kubernetes.io/name={}", part.daemonset().0);
            let mut said = String::new();
            for args in [
                ["describe", "pod", "-n", SYSTEM, "-l", &selector],
                ["logs", "-n", SYSTEM, "-l", &selector, "--tail=30"],
            ] {
                said += &kubectl(&args).await.unwrap_or_else(|e| e.to_string());
            }
            panic!("{what}: {e}\n{said}");
        }
    };
    let pod = pods
        .into_iter()
        .find(|p| is_part(p, part))
        .expect("the part's pod");
    let spec = pod.spec.clone().expect("spec");
    assert_eq!(spec.node_name.as_deref(), Some(node));
    let container = &spec.containers[0];
    assert_eq!(container.args, shipped.args);
    assert_eq!(env(container), env(&shipped));
    // The pod's mounts are the manifest's, and its ServiceAccount token.
    let mounts: Vec<_> = container
        .volume_mounts
        .iter()
        .flatten()
        .filter(|m| !m.name.starts_with("kube-api-access-"))
        .cloned()
        .collect();
    assert_eq!(mounts, shipped.volume_mounts.clone().unwrap_or_default());
    pod
}

/// A container's security context, less what the API server fills in.
fn security_context(c: &Container) -> Option<SecurityContext> {
    c.security_context.clone().map(|s| SecurityContext {
        proc_mount: None,
        ..s
    })
}

/// A container's environment: each name with its value or the field it is
/// taken from.
fn env(c: &Container) -> Vec<(String, Option<String>, Option<String>)> {
    c.env
        .iter()
        .flatten()
        .map(|e| {
            let field = e
                .value_from
                .as_ref()
                .and_then(|f| f.field_ref.as_ref())
                .map(|f| f.field_path.clone());
            (e.name.clone(), e.value.clone(), field)
        })
        .collect()
}

#[tokio::test]
async fn the_shipped_install_takes_a_real_node_from_the_incident_back_to_serving() {
    let client = client().await.expect("client");
    let mut node = RealNode::up().await.expect("the real node");
    let host = &node.host;
    let nodes: Api<Node> = Api::all(client.clone());
    let archives: Vec<PathBuf> = shipped_images()
        .expect("make images")
        .into_iter()
        .map(|(a, _)| a)
        .collect();
    node.import(&archives).await.expect("the images, imported");
    let images = node.test_images().await.expect("the test's images");

    // NVIDIA's device plugin as the GPU Operator runs it: a DaemonSet on
    // the nodes whose label says so, which a reset pauses.
    apply(&format!(
        r#"
apiVersion: v1
kind: Namespace
metadata: {{name: gpu-operator}}
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {{name: nvidia-device-plugin-daemonset, namespace: gpu-operator}}
spec:
  selector: {{matchLabels: {{app: nvidia-device-plugin-daemonset}}}}
  template:
    metadata: {{labels: {{app: nvidia-device-plugin-daemonset}}}}
    spec:
      nodeSelector: {{"{DEVICE_PLUGIN_LABEL}": "true"}}
      tolerations: [{{operator: Exists}}]
      terminationGracePeriodSeconds: 1
      containers:
        - name: plugin
          image: {plugin}
          args: ["--root={standin}"]
          volumeMounts:
            - {{name: plugins, mountPath: /var/lib/kubelet/device-plugins}}
            - {{name: cdi, mountPath: /var/run/cdi}}
            - {{name: gpus, mountPath: "{standin}"}}
      volumes:
        - {{name: plugins, hostPath: {{path: /var/lib/kubelet/device-plugins}}}}
        - {{name: cdi, hostPath: {{path: /var/run/cdi, type: DirectoryOrCreate}}}}
        - {{name: gpus, hostPath: {{path: "{standin}"}}}}
"#,
        plugin = images.device_plugin,
        standin = host.nvml().display(),
    ))
    .await;
    until(nodes.clone(), &node.name, WAIT, |n| {
        allocatable_gpus(n).as_deref() == Some("8")
    })
    .await
    .expect("the device plugin offers 8 GPUs");

    // The install as shipped.
    install("container-toolkit").await;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), SYSTEM);
    until(deployments, "gpuhealth-operator", WAIT, |d| {
        d.status
            .as_ref()
            .is_some_and(|s| s.available_replicas.unwrap_or(0) == 2)
    })
    .await
    .expect("the operator's pods available: in-cluster config, its token, its probes");
    // The shipped affinity keeps the operator off GPU nodes, and this
    // cluster has one node: its pods were placed before GPU feature
    // discovery (here, the test) labelled the node a GPU node, which they
    // outlive (IgnoredDuringExecution); the agent's DaemonSet follows the
    // label.
    kubectl(&["label", "node", &node.name, "nvidia.com/gpu.present=true"])
        .await
        .expect("the node labelled a GPU node");
    let reporter = agent_as_shipped(&client, &node.name, "container-toolkit", Part::Reporter).await;
    let executor = agent_as_shipped(&client, &node.name, "container-toolkit", Part::Executor).await;
    for pod in [&reporter, &executor] {
        let context = pod.spec.clone().expect("spec").containers[0]
            .security_context
            .clone()
            .expect("security context");
        assert_eq!(context.privileged, Some(false));
        assert_eq!(context.read_only_root_filesystem, Some(true));
    }
    // As the kernel holds them: the reporter with the one capability its
    // container adds, outside the host's PID namespace (the host's
    // processes and their roots out of its sight), without the system bus;
    // the executor with its own four, the host's processes and the bus.
    let mask = |caps: &[&str]| {
        capability_mask(&caps.iter().map(|c| (*c).to_owned()).collect::<Vec<_>>()).expect("mask")
    };
    assert_eq!(
        confinement(container_process(&reporter)),
        Confinement {
            effective: mask(&["syslog"]),
            no_new_privileges: true,
            host_pids: false,
            system_bus: false,
        },
        "the reporter"
    );
    assert_eq!(
        confinement(container_process(&executor)),
        Confinement {
            effective: mask(&["sys_admin", "sys_boot", "sys_ptrace", "dac_read_search"]),
            no_new_privileges: true,
            host_pids: true,
            system_bus: true,
        },
        "the executor"
    );

    // The agent's report, from NVML in its container, with what it checked.
    let n = until(nodes.clone(), &node.name, WAIT, |n| {
        report(n).is_some_and(|r| {
            r.gpus.len() == 8 && r.unreadable.is_none() && r.capabilities.is_some_and(|c| c.reset)
        })
    })
    .await
    .expect("the reporter's report from the real node, with the executor's offer");
    let r = report(&n).expect("report");
    assert_eq!(
        r.capabilities.map(|c| (c.reset, c.reboot)),
        Some((true, gpuhealth_api::contract::RebootMethod::Logind)),
        "NVML answers, nvidia-smi runs, logind answers on the shipped bus path"
    );

    // A policy of the user's, and a GPU workload on each GPU.
    apply(&format!(
        r#"
apiVersion: gpuhealth.io/v1alpha1
kind: GpuHealthPolicy
metadata: {{name: real-node}}
spec:
  nodeSelector: {{matchLabels: {{nvidia.com/gpu.present: "true"}}}}
  mode: Enforce
  escalation:
    - {{action: GpuReset, attempts: 1, timeout: 5m}}
    - {{action: NodeReboot, timeout: 30m}}
  # The operator runs on this GPU node only because the cluster has no
  # other: a reboot's drain leaves it be.
  drain: {{scope: AffectedPods, gracePeriod: 5s, timeout: 2m, excludeNamespaces: [{SYSTEM}]}}
  verification: {{stableFor: 10s, timeout: 5m}}
  # The second fault comes right after the first's recovery.
  remediationLimits: {{cooldown: 0s}}
---
apiVersion: v1
kind: Namespace
metadata: {{name: {SERVING}}}
---
apiVersion: apps/v1
kind: Deployment
metadata: {{name: model-server, namespace: {SERVING}}}
spec:
  replicas: 8
  selector: {{matchLabels: {{app: model-server}}}}
  template:
    metadata: {{labels: {{app: model-server}}}}
    spec:
      terminationGracePeriodSeconds: 2
      containers:
        - name: server
          image: {workload}
          resources: {{limits: {{nvidia.com/gpu: 1}}}}
"#,
        workload = images.workload,
    ))
    .await;
    pods_until(&client, SERVING, "eight workload pods Ready", |pods| {
        running_ready(pods) == 8
    })
    .await;
    let n = until(nodes.clone(), &node.name, WAIT, |n| {
        report(n).is_some_and(|r| r.gpus.iter().all(|g| g.pods.len() == 1))
    })
    .await
    .expect("every GPU's pod named by the real kubelet's PodResources");
    let before = report(&n).expect("report");
    let on_gpu7 = before.gpus[7].pods[0].name.clone();
    let on_others: Vec<String> = before.gpus[..7]
        .iter()
        .map(|g| g.pods[0].name.clone())
        .collect();

    // A tenant forges the driver's words about GPU 3 by crashing: the real
    // kernel logs it, and the reporter, following that log through
    // syslog(2) as shipped, reads no Xid in it; the node is not cordoned.
    let bus3 = before.gpus[3].pci_bus_id[4..14].to_lowercase();
    forge_xids_by_crashing(&client, &images.workload, &bus3).await;
    let n = nodes.get(&node.name).await.expect("node");
    assert!(!is_cordoned(&n), "cordoned for a tenant's crash");
    let r = report(&n).expect("report");
    assert!(
        r.gpus.iter().all(|g| g.xids.is_empty()),
        "an Xid read from a tenant's crash: {:?}",
        r.gpus
    );

    // GPU 7 as in the incident: Xid 119, then 154 asking for a reset.
    host.set(7, "recovery_action", "1")
        .expect("recovery action");
    host.nvml_xid(7, 119).expect("Xid 119");
    host.nvml_xid(7, 154).expect("Xid 154");
    let records: Api<GpuNodeHealth> = Api::all(client.clone());
    let record = until(records.clone(), &node.name, WAIT * 2, |h| {
        h.status.as_ref().is_some_and(|s| {
            s.phase == Phase::Healthy
                && s.history
                    .first()
                    .is_some_and(|i| i.outcome == Some(IncidentOutcome::Recovered))
        })
    })
    .await
    .expect("back to Healthy");
    let incident = record.status.expect("status").history[0].clone();
    assert_eq!(incident.gpus, [uuid(7)]);
    // The reporter read what came after the forgery: GPU 3, whose words
    // it was, still has no Xid.
    let n = nodes.get(&node.name).await.expect("node");
    assert!(
        report(&n).is_some_and(|r| r.gpus[3].xids.is_empty()),
        "{:?}",
        report(&n)
    );

    // The pod on GPU 7 moved; the others stayed.
    let pods: Api<Pod> = Api::namespaced(client.clone(), SERVING);
    assert!(
        pods.get_opt(&on_gpu7).await.expect("pod").is_none(),
        "GPU 7's pod moved"
    );
    for name in &on_others {
        let p = pods.get_opt(name).await.expect("pod");
        assert!(
            p.is_some_and(|p| p.metadata.deletion_timestamp.is_none()),
            "{name} stayed"
        );
    }
    // One reset, of GPU 7, by nvidia-smi in the agent's container, with
    // persistenced let go and the device plugin paused; everything back.
    assert_eq!(host.resets(), [(uuid(7), "ok".to_owned())]);
    let n = nodes.get(&node.name).await.expect("node");
    let r = result(&n).expect("the reset's result");
    assert_eq!(r.outcome, Outcome::Succeeded, "{r:?}");
    for said in [
        "persistence mode turned off for it and on again",
        "paused and restored: nvidia.com/gpu.deploy.device-plugin",
        "offers 8 of 8 nvidia.com/gpu",
    ] {
        assert!(r.message.contains(said), "{said:?} in {:?}", r.message);
    }
    assert_eq!(host.get(7, "persistence").as_deref(), Some("1"));
    assert_eq!(
        n.labels().get(DEVICE_PLUGIN_LABEL).map(String::as_str),
        Some("true")
    );
    assert!(!is_cordoned(&n));
    assert_eq!(allocatable_gpus(&n).as_deref(), Some("8"));
    assert_eq!(
        report(&n).expect("report").gpus[7].health,
        GpuHealth::Healthy
    );
    let plugins: Api<DaemonSet> = Api::namespaced(client.clone(), "gpu-operator");
    let plugin = plugins
        .get("nvidia-device-plugin-daemonset")
        .await
        .expect("plugin");
    assert_eq!(
        plugin.status.map(|s| s.number_ready),
        Some(1),
        "the plugin's pod is back"
    );
    // The workload whole again: the replacement on the reset GPU.
    pods_until(
        &client,
        SERVING,
        "eight workload pods Ready again",
        |pods| running_ready(pods) == 8,
    )
    .await;

    // The same node as one whose driver comes from the GPU Operator's
    // driver container: nvidia-persistenced runs from the driver root, and
    // the agent is installed with config/agent/driver-root: privileged,
    // NVML and nvidia-smi from the root (by path, and by the root's own
    // loader), persistenced's socket from inside the root.
    node.host
        .persistenced_in_driver_root(Path::new(DRIVER_ROOT))
        .await
        .expect("nvidia-persistenced in the driver root");
    let host = &node.host;
    install("driver-root").await;
    let agent = agent_as_shipped(&client, &node.name, "driver-root", Part::Reporter).await;
    agent_as_shipped(&client, &node.name, "driver-root", Part::Executor).await;
    let started = agent
        .status
        .and_then(|s| s.start_time)
        .expect("the agent's start");
    let n = until(nodes.clone(), &node.name, WAIT, |n| {
        report(n).is_some_and(|r| {
            r.observed_at >= started
                && r.gpus.len() == 8
                && r.unreadable.is_none()
                && r.capabilities.is_some_and(|c| c.reset)
        })
    })
    .await
    .expect("a report from the driver root's NVML");
    assert_eq!(
        report(&n)
            .and_then(|r| r.capabilities)
            .map(|c| (c.reset, c.reboot)),
        Some((true, gpuhealth_api::contract::RebootMethod::Logind)),
        "the root's NVML answers, its nvidia-smi runs, logind answers"
    );
    // The incident again, on GPU 5.
    host.set(5, "recovery_action", "1")
        .expect("recovery action");
    host.nvml_xid(5, 119).expect("Xid 119");
    host.nvml_xid(5, 154).expect("Xid 154");
    let record = until(records.clone(), &node.name, WAIT * 2, |h| {
        h.status.as_ref().is_some_and(|s| {
            s.phase == Phase::Healthy
                && s.history.first().is_some_and(|i| {
                    i.gpus == [uuid(5)] && i.outcome == Some(IncidentOutcome::Recovered)
                })
        })
    })
    .await
    .expect("back to Healthy after GPU 5's reset");
    assert_eq!(record.status.map(|s| s.history.len()), Some(2));
    assert_eq!(
        host.resets(),
        [(uuid(7), "ok".to_owned()), (uuid(5), "ok".to_owned())]
    );
    let n = nodes.get(&node.name).await.expect("node");
    let r = result(&n).expect("the reset's result");
    assert_eq!(r.outcome, Outcome::Succeeded, "{r:?}");
    assert!(
        r.message
            .contains("persistence mode turned off for it and on again"),
        "{}",
        r.message
    );
    assert_eq!(host.get(5, "persistence").as_deref(), Some("1"));
    assert!(!is_cordoned(&n));
    pods_until(
        &client,
        SERVING,
        "eight workload pods Ready after GPU 5's reset",
        |pods| running_ready(pods) == 8,
    )
    .await;

    // GPU 3's reset fails: the ladder's next rung, a reboot, reaches
    // logind once, through the bus socket the manifest mounts.
    host.set(3, "reset", "fail").expect("a reset that fails");
    host.set(3, "recovery_action", "1")
        .expect("recovery action");
    host.nvml_xid(3, 154).expect("Xid 154");
    let reboots = host.reboots.clone();
    let deadline = tokio::time::Instant::now() + WAIT * 2;
    while *reboots.lock().expect("count") == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no reboot reached logind"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let n = until(nodes.clone(), &node.name, WAIT, |n| {
        result(n).is_some_and(|r| r.id.to_string().contains("reboot"))
    })
    .await
    .expect("the reboot's result");
    let r = result(&n).expect("result");
    assert_eq!(r.outcome, Outcome::Succeeded, "{r:?}");
    assert!(
        r.message.contains("systemd-logind accepted"),
        "{}",
        r.message
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(*reboots.lock().expect("count"), 1, "asked once");
    assert!(
        host.resets().contains(&(uuid(3), "failed".to_owned())),
        "{:?}",
        host.resets()
    );
}

/// A tenant's pod on the node forging Xids about the GPU at `bus`
/// (`0000:3b:00`) by crashing: a process named like the start of the
/// driver's line crashes in a file named like the rest of it (as the
/// issue that found it did), and one crashes in a file whose name holds a
/// newline and then a whole line of the driver's (which `syslog(2)` prints
/// as a line of its own). Returns once the real kernel has logged both and
/// the reporter has had time to read them: it reads the buffer each second
/// and publishes at once on a new Xid.
async fn forge_xids_by_crashing(client: &Client, image: &str, bus: &str) {
    let same_line = format!("x {bus}): 79, y");
    let next_line = format!("NVRM: Xid (PCI:{bus}): 79, GPU has fallen off the bus.");
    let pod: Pod = serde_json::from_value(serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "tenant-forger", "namespace": SERVING},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {"name": "same-line", "image": image,
                 "args": ["--crash-in", format!("/work/{same_line}"), "NVRM: Xid ("],
                 "volumeMounts": [{"name": "work", "mountPath": "/work"}]},
                {"name": "next-line", "image": image,
                 "args": ["--crash-in", format!("/work/z\n{next_line}"), "NVRM: Xid (PCI:"],
                 "volumeMounts": [{"name": "work", "mountPath": "/work"}]},
            ],
            "volumes": [{"name": "work", "emptyDir": {}}],
        },
    }))
    .expect("the forger's pod");
    let pods: Api<Pod> = Api::namespaced(client.clone(), SERVING);
    pods.create(&Default::default(), &pod)
        .await
        .expect("the forger's pod created");
    until(pods, "tenant-forger", WAIT, |p| {
        let crashed = p
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .map_or(0, |cs| {
                cs.iter()
                    .filter(|c| {
                        c.state
                            .as_ref()
                            .and_then(|s| s.terminated.as_ref())
                            .is_some_and(|t| t.exit_code != 0)
                    })
                    .count()
            });
        crashed == 2
    })
    .await
    .expect("both its processes crashed");
    // As syslog(2) gives the kernel's buffer to the reporter.
    let mut buffer = Vec::new();
    let log = gpuhealth_klog::read_all(&mut buffer).expect("the kernel's log");
    assert!(
        log.lines().any(|l| l.contains("NVRM: Xid ([")
            && l.contains("segfault at 0")
            && l.contains(&same_line)),
        "the kernel logged the first crash"
    );
    assert!(
        log.lines().any(|l| l
            .split_once("] ")
            .is_some_and(|(_, message)| message.starts_with(&next_line))),
        "the kernel logged the second crash's file name as a line of its own"
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
}
