//! The install round trip on the real API server: `kubectl apply -k
//! config/default` installs everything (the Deployment's pods are scheduled
//! and KWOK runs them; the agent DaemonSet's pod lands on the GPU node); the
//! operator binary, run as a process with its ServiceAccount's own token,
//! takes a node through the incident with everything it needs allowed (its
//! log has no refusal in it) and what it must never do refused; it checks
//! its admission protection, and enforces nothing while a binding is
//! missing; then `kubectl delete -k config/default` leaves nothing of it
//! behind.

use std::time::Duration;

use gpuhealth_api::{GpuHealthPolicy, node_health::Phase, vocabulary::Reason};
use gpuhealth_e2e::{
    client,
    cluster::{client_with_token, kubeconfig_with_token},
    identities, kubectl,
    operator::{self, Options},
    overlay,
    scenario::{Scenario, WAIT},
    sim::{gpu_operator_runtime_class, pod_is_ready},
    unique, wait,
};
use k8s_openapi::api::{
    apps::v1::{DaemonSet, Deployment},
    coordination::v1::Lease,
    core::v1::{Namespace, Node, Pod, PodTemplateSpec, Secret, ServiceAccount},
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams},
    runtime::watcher,
};
use serde_json::json;

const NAMESPACE: &str = "gpuhealth-system";
const ACCOUNT: &str = "gpuhealth-operator";

const DEFAULT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/default");
const ADMISSION: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/admission");

/// How often the operator checks its admission protection here.
const PROTECTION_CHECKED_EVERY: Duration = Duration::from_secs(2);

/// Waits until `policy`'s `Ready` condition has `reason`, and returns it.
async fn policy_ready(admin: &Client, policy: &str, reason: &str) -> Condition {
    let found = wait::until(
        Api::<GpuHealthPolicy>::all(admin.clone()),
        policy,
        WAIT,
        |p| ready_of(p).is_some_and(|c| c.reason == reason),
    )
    .await
    .unwrap_or_else(|e| panic!("policy {policy} Ready with reason {reason}: {e}"));
    ready_of(&found).cloned().expect("Ready")
}

fn ready_of(policy: &GpuHealthPolicy) -> Option<&Condition> {
    policy
        .status
        .as_ref()?
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
}

/// The operator's pods meet the `restricted` Pod Security Standard: its
/// template is admitted (a server-side dry run) in a namespace that enforces
/// it, and the agent's, which needs host access, is not.
async fn restricted_pod_security(admin: &Client, group: &str) {
    let namespace = format!("{group}-restricted");
    let namespaces: Api<Namespace> = Api::all(admin.clone());
    let labelled: Namespace = serde_json::from_value(json!({
        "metadata": {
            "name": namespace,
            "labels": {"pod-security.kubernetes.io/enforce": "restricted"},
        },
    }))
    .expect("namespace");
    namespaces
        .create(&PostParams::default(), &labelled)
        .await
        .expect("a restricted namespace");
    // The pods' ServiceAccounts, for the ServiceAccount admission plugin.
    let accounts: Api<ServiceAccount> = Api::namespaced(admin.clone(), &namespace);
    for name in [ACCOUNT, "gpuhealth-agent"] {
        let account = ServiceAccount {
            metadata: ObjectMeta {
                name: Some(name.into()),
                ..Default::default()
            },
            ..Default::default()
        };
        accounts
            .create(&PostParams::default(), &account)
            .await
            .expect("a ServiceAccount");
    }
    let pod_of = |template: Option<PodTemplateSpec>| Pod {
        metadata: ObjectMeta {
            name: Some(unique("pss")),
            ..Default::default()
        },
        spec: template.and_then(|t| t.spec),
        ..Default::default()
    };
    let dry_run = PostParams {
        dry_run: true,
        ..Default::default()
    };
    let pods: Api<Pod> = Api::namespaced(admin.clone(), &namespace);
    let operator = Api::<Deployment>::namespaced(admin.clone(), NAMESPACE)
        .get("gpuhealth-operator")
        .await
        .expect("the operator Deployment");
    pods.create(&dry_run, &pod_of(operator.spec.map(|s| s.template)))
        .await
        .expect("the operator's pod meets the restricted standard");
    let agent = Api::<DaemonSet>::namespaced(admin.clone(), NAMESPACE)
        .get("gpuhealth-agent")
        .await
        .expect("the agent DaemonSet");
    match pods
        .create(&dry_run, &pod_of(agent.spec.map(|s| s.template)))
        .await
    {
        Err(kube::Error::Api(s)) if s.code == 403 && s.message.contains("PodSecurity") => {}
        other => panic!("the agent's pod needs host access, so restricted refuses it: {other:?}"),
    }
    let _ = namespaces
        .delete(&namespace, &DeleteParams::default())
        .await;
}

fn refused<T: std::fmt::Debug>(what: &str, result: Result<T, kube::Error>) {
    match result {
        Err(kube::Error::Api(s)) if s.code == 403 => {}
        other => panic!("{what} must be refused (403): {other:?}"),
    }
}

#[tokio::test]
async fn install_run_the_incident_on_the_operators_own_rights_and_uninstall() {
    let admin = client().await.expect("client");
    let (mut s, cpu) = Scenario::for_an_install("install").await.expect("scenario");
    let node = s.nodes[0].clone();
    let nodes: Api<Node> = Api::all(admin.clone());
    // --force-conflicts: the harness applied the same CRDs as its own manager.
    kubectl(&["apply", "--server-side", "--force-conflicts", "-k", DEFAULT])
        .await
        .expect("kubectl apply -k config/default");
    let deployment = wait::until(
        Api::<Deployment>::namespaced(admin.clone(), NAMESPACE),
        "gpuhealth-operator",
        WAIT,
        |d| d.status.as_ref().and_then(|s| s.ready_replicas) == Some(2),
    )
    .await
    .expect("both operator replicas scheduled and running");
    assert_eq!(deployment.spec.and_then(|s| s.replicas), Some(2));
    let operator_pods = wait::until_set(
        Api::<Pod>::namespaced(admin.clone(), NAMESPACE),
        watcher::Config::default().labels("app.kubernetes.io/name=gpuhealth-operator"),
        "the operator's pods",
        WAIT,
        |pods| pods.len() == 2 && pods.values().all(pod_is_ready),
    )
    .await
    .expect("operator pods");
    for pod in operator_pods.values() {
        let on = pod.spec.as_ref().and_then(|s| s.node_name.clone());
        let on = nodes.get(&on.unwrap_or_default()).await.expect("its node");
        assert!(
            !on.labels().contains_key("nvidia.com/gpu.present"),
            "never on a GPU node: {:?}",
            on.metadata.name
        );
    }
    wait::until_set(
        Api::<Pod>::namespaced(admin.clone(), NAMESPACE),
        watcher::Config::default()
            .labels("app.kubernetes.io/name=gpuhealth-agent")
            .fields(&format!("spec.nodeName={node}")),
        "the agent's pod on the GPU node",
        WAIT,
        |pods| pods.values().any(pod_is_ready),
    )
    .await
    .expect("the agent DaemonSet runs on the GPU node");
    assert!(
        Api::<DaemonSet>::namespaced(admin.clone(), NAMESPACE)
            .get("gpuhealth-agent")
            .await
            .is_ok()
    );

    restricted_pod_security(&admin, &s.group).await;

    // The real binaries run as processes, the operator as its ServiceAccount.
    let token = identities::token(&admin, NAMESPACE, ACCOUNT, None)
        .await
        .expect("a token for the operator's ServiceAccount");
    s.add_pdb("vllm", 1).await.expect("pdb");
    s.start_agent();
    let kubeconfig = std::env::temp_dir().join(format!("{}-operator.kubeconfig", s.group));
    let kubeconfig = kubeconfig_with_token(&token, &kubeconfig)
        .await
        .expect("kubeconfig");
    let operator = operator::start_with(
        &format!("{}-operator", s.group),
        Options {
            kubeconfig: Some(kubeconfig),
            namespace: Some(NAMESPACE.into()),
            admission_check: Some(PROTECTION_CHECKED_EVERY),
            // The install's defaults.
            guardrails: Some(Vec::new()),
            ..Default::default()
        },
    )
    .await
    .expect("operator");
    s.operator = Some(operator);
    s.wait_taken_in().await.expect("taken in");
    policy_ready(&admin, &s.policy, "Managing").await;

    // The incident, end to end: watch, cordon, evict behind a PDB, request,
    // verify, uncordon, Events, statuses, the Lease, the workload check.
    s.break_gpu(&node, 7).await.expect("break");
    s.wait_recovered(&node)
        .await
        .expect("recovered as the ServiceAccount");
    s.wait_workloads_judged(&node).await.expect("judged");

    // Protection checked, not assumed: with the agent keys' binding gone,
    // anyone who may patch Nodes could forge a report. The policy says so
    // within the check's interval, and a report of a bad GPU changes
    // nothing; bound again, the incident goes ahead.
    kubectl(&[
        "delete",
        "validatingadmissionpolicybinding",
        "gpuhealth-agent-keys",
    ])
    .await
    .expect("the binding deleted");
    let ready = policy_ready(&admin, &s.policy, Reason::Unprotected.as_str()).await;
    assert!(ready.message.contains("agent-keys"), "{}", ready.message);
    s.break_gpu(&node, 7).await.expect("break");
    let held = s
        .wait_status(&node, "held: nothing enforced", |st| {
            st.reason == Some(Reason::Unprotected)
        })
        .await
        .expect("held");
    assert_eq!(held.phase, Phase::Suspect, "{held:?}");
    assert_ne!(
        s.node(&node)
            .await
            .expect("node")
            .spec
            .and_then(|s| s.unschedulable),
        Some(true),
        "never cordoned while unprotected"
    );
    kubectl(&["apply", "--server-side", "-k", ADMISSION])
        .await
        .expect("the binding back");
    policy_ready(&admin, &s.policy, "Managing").await;
    s.wait_recovered(&node)
        .await
        .expect("the incident, once protected again");
    let log = s
        .operator
        .as_ref()
        .map(|o| std::fs::read_to_string(&o.log).unwrap_or_default())
        .unwrap_or_default();
    assert!(
        !log.contains("forbidden") && !log.contains("Forbidden"),
        "the operator was refused something it needs:\n{log}"
    );
    // It led from its own namespace, with its own rights.
    let lease = Api::<Lease>::namespaced(admin.clone(), NAMESPACE)
        .get(&format!("{}-operator", s.group))
        .await
        .expect("its Lease in gpuhealth-system");
    assert_eq!(
        lease.spec.and_then(|l| l.holder_identity),
        Some(format!("{}-operator", s.group))
    );

    // And what it must never do.
    let sa = client_with_token(&token).await.expect("client");
    refused(
        "reading Secrets",
        Api::<Secret>::all(sa.clone())
            .list(&ListParams::default())
            .await,
    );
    refused(
        "reading a Secret in its own namespace",
        Api::<Secret>::namespaced(sa.clone(), NAMESPACE)
            .get("anything")
            .await,
    );
    refused(
        "patching a Deployment",
        Api::<Deployment>::namespaced(sa.clone(), &s.namespace)
            .patch(
                "vllm",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"replicas": 0}})),
            )
            .await,
    );
    refused(
        "deleting a Node",
        Api::<Node>::all(sa.clone())
            .delete(&node, &DeleteParams::default())
            .await,
    );
    let pods = s.pods_on(&node).await.expect("pods");
    let as_operator = Api::<Pod>::namespaced(sa.clone(), &s.namespace);
    refused(
        "deleting a pod it never told it leaves with its gang (force-delete is opt-in: config/rbac-force-delete)",
        as_operator.delete(&pods[0], &DeleteParams::default()).await,
    );
    // It may patch pods for a gang's notice, and admission holds it to that.
    for (what, patch) in [
        (
            "changing a pod's image",
            json!({"spec": {"containers": [{"name": "server", "image": "evil:latest"}]}}),
        ),
        (
            "changing a pod's labels",
            json!({"metadata": {"labels": {"app": "other"}}}),
        ),
        (
            "writing another annotation on a pod",
            json!({"metadata": {"annotations": {"example.com/x": "y"}}}),
        ),
    ] {
        refused(
            what,
            as_operator
                .patch(&pods[0], &PatchParams::default(), &Patch::Strategic(patch))
                .await,
        );
    }
    as_operator
        .patch(
            &pods[0],
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"annotations": {"gpuhealth.io/evict-at": "2026-12-05T00:00:00Z"}}})),
        )
        .await
        .expect("the operator tells a pod it leaves with its gang");
    let told: Pod = serde_json::from_value(json!({
        "metadata": {"name": "told", "annotations": {"gpuhealth.io/evict-at": "2026-12-05T00:00:00Z"}},
        "spec": {"containers": [{"name": "c", "image": "busybox"}], "nodeName": cpu},
    }))
    .expect("a pod");
    Api::<Pod>::namespaced(admin.clone(), &s.namespace)
        .create(&PostParams::default(), &told)
        .await
        .expect("a pod told it leaves with its gang");
    as_operator
        .delete("told", &DeleteParams::default())
        .await
        .expect("the operator deletes a pod it told");
    // And its own validation pods, once an attempt is verified.
    let validation: Pod = serde_json::from_value(json!({
        "metadata": {"name": "own-validation", "labels": {"app.kubernetes.io/managed-by": "gpuhealth"}},
        "spec": {"containers": [{"name": "c", "image": "busybox"}], "nodeName": cpu},
    }))
    .expect("a pod");
    Api::<Pod>::namespaced(admin.clone(), &s.namespace)
        .create(&PostParams::default(), &validation)
        .await
        .expect("a pod labelled as gpuhealth's");
    as_operator
        .delete("own-validation", &DeleteParams::default())
        .await
        .expect("the operator deletes a validation pod of its own");
    // Pods only where validation pods run: not a workload's namespace, not
    // its own (where the agent's ServiceAccount is).
    for namespace in [s.namespace.as_str(), NAMESPACE] {
        refused(
            &format!("creating a pod in {namespace}"),
            Api::<Pod>::namespaced(sa.clone(), namespace)
                .create(
                    &PostParams::default(),
                    &serde_json::from_value(json!({
                        "metadata": {"name": "not-allowed"},
                        "spec": {"serviceAccountName": "gpuhealth-agent",
                                 "containers": [{"name": "c", "image": "x"}]},
                    }))
                    .expect("pod"),
                )
                .await,
        );
    }

    // Uninstall: stop the operator process, then delete what was applied.
    if let Some(mut operator) = s.operator.take() {
        operator.kill().await;
    }
    kubectl(&["delete", "-k", DEFAULT, "--wait", "--timeout=240s"])
        .await
        .expect("kubectl delete -k config/default");
    let left = kubectl(&["get", "-k", DEFAULT, "--ignore-not-found", "-o", "name"])
        .await
        .expect("kubectl get -k config/default");
    assert!(left.trim().is_empty(), "left behind:\n{left}");
    let _ = nodes.delete(&cpu, &DeleteParams::default()).await;
}

/// The same install moved by kustomize (`namespace:` and `nameSuffix:` over
/// the shipped bases, as a user's overlay would): the operator, on its moved
/// ServiceAccount's own token, takes a node through the incident with the
/// admission policies in force, refused nothing; then it all goes.
#[tokio::test]
async fn the_install_moved_to_another_namespace_still_remediates() {
    let admin = client().await.expect("client");
    let mut s = Scenario::new("moved", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    gpu_operator_runtime_class(&admin)
        .await
        .expect("the nvidia RuntimeClass");
    let namespace = format!("{}-system", s.group);
    // The agent's DaemonSet kept to this scenario's node; the operator's
    // Deployment scaled to none (its process runs below, as in the test
    // above); the guardrail written into admission as config/default does.
    let replacements = overlay::shipped_replacements().expect("config/default's replacements");
    let kustomization = format!(
        r#"namespace: {namespace}
nameSuffix: -moved
resources:
  - ../../../config/namespace
  - ../../../config/rbac
  - ../../../config/admission
  - ../../../config/operator
  - ../../../config/agent/container-toolkit
patches:
  - target: {{kind: DaemonSet}}
    patch: |-
      - op: replace
        path: /spec/template/spec/nodeSelector
        value: {{kubernetes.io/hostname: "{node}"}}
  - target: {{kind: Deployment}}
    patch: |-
      - op: replace
        path: /spec/replicas
        value: 0
{replacements}"#
    );
    let dir = overlay::write(&s.group, &kustomization).expect("the overlay");
    kubectl(&["apply", "--server-side", "-k", &dir])
        .await
        .expect("the moved install");

    let token = identities::token(&admin, &namespace, "gpuhealth-operator-moved", None)
        .await
        .expect("a token for the moved operator");
    s.start_agent();
    let kubeconfig = std::env::temp_dir().join(format!("{}-operator.kubeconfig", s.group));
    let kubeconfig = kubeconfig_with_token(&token, &kubeconfig)
        .await
        .expect("kubeconfig");
    s.operator = Some(
        operator::start_with(
            &format!("{}-operator", s.group),
            Options {
                kubeconfig: Some(kubeconfig),
                namespace: Some(namespace.clone()),
                ..Default::default()
            },
        )
        .await
        .expect("operator"),
    );
    s.wait_taken_in().await.expect("taken in");
    s.break_gpu(&node, 7).await.expect("break");
    s.wait_recovered(&node)
        .await
        .expect("recovered as the moved ServiceAccount");
    let log = s
        .operator
        .as_ref()
        .map(|o| std::fs::read_to_string(&o.log).unwrap_or_default())
        .unwrap_or_default();
    assert!(
        !log.contains("forbidden") && !log.contains("Forbidden") && !log.contains("denied request"),
        "the moved operator was refused something it needs:\n{log}"
    );

    if let Some(mut operator) = s.operator.take() {
        operator.kill().await;
    }
    kubectl(&["delete", "-k", &dir, "--wait", "--timeout=240s"])
        .await
        .expect("remove the moved install");
}
