//! The chart on the real API server, with the Helm the repository pins
//! (scripts/helm.sh): `helm install` of charts/gpuhealth, packaged as a
//! release packages it (`helm package`: its links to config/ resolved), into a namespace of
//! its own (its pods scheduled; KWOK runs them, the agent's on the GPU
//! node); the operator binary, on the chart's ServiceAccount's own token,
//! and the agent binary take a node through the incident to Healthy; `helm
//! upgrade` to another reboot method and agent image tag while a second
//! incident is held in its drain, the agent processes rolled as the DaemonSet's
//! rolling update rolls their pods (stopped, perhaps mid-request, and
//! started again on their journal), the admission policies patched in place,
//! never gone; an independent recorder's timeline of the whole run checked
//! against the chaos checker's invariants; then `helm uninstall` leaves
//! only what Helm keeps by rule: the CRDs, the policies and node records
//! they hold, and the namespace `--create-namespace` made.
//!
//! What the new reboot method changes in the agent is the agent's own
//! tests' (the fake backend here carries out what it is asked); this file
//! shows what Helm does to a running install.

use std::collections::BTreeMap;

use gpuhealth_api::{GpuHealthPolicy, node_health::Phase};
use gpuhealth_e2e::{
    client,
    cluster::kubeconfig_with_token,
    helm, identities,
    invariants::{self, Expectations},
    kubectl,
    operator::Options,
    recorder::Recorder,
    scenario::{Scenario, WAIT},
    sim::pod_is_ready,
    wait,
};
use k8s_openapi::api::{
    admissionregistration::v1::{ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding},
    apps::v1::DaemonSet,
    core::v1::{Namespace, Node, Pod},
    policy::v1::PodDisruptionBudget,
};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, ListParams, PostParams},
    runtime::watcher,
};
use serde::Deserialize;

const RELEASE: &str = "gpuhealth";
const NAMESPACE: &str = "gpuhealth-helm";
const CHART: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../charts/gpuhealth");

/// The chart packaged into a directory of the test's, as `make release`
/// packages it: the `.tgz` to install.
async fn packaged(group: &str) -> String {
    let dir = std::env::temp_dir().join(format!("{group}-chart"));
    let _ = std::fs::remove_dir_all(&dir);
    let dir = dir.to_string_lossy().into_owned();
    helm(&["package", CHART, "--destination", &dir])
        .await
        .expect("helm package");
    let version = env!("CARGO_PKG_VERSION");
    format!("{dir}/gpuhealth-{version}.tgz")
}

/// Every ValidatingAdmissionPolicy and binding gpuhealth ships, by name,
/// with its uid: the same uid after an upgrade is the same object, patched,
/// never deleted and made again (which would leave a moment unguarded).
async fn admission_objects(admin: &Client) -> BTreeMap<String, String> {
    let params = ListParams::default();
    let policies = Api::<ValidatingAdmissionPolicy>::all(admin.clone())
        .list(&params)
        .await
        .expect("policies");
    let bindings = Api::<ValidatingAdmissionPolicyBinding>::all(admin.clone())
        .list(&params)
        .await
        .expect("bindings");
    let named = policies
        .items
        .iter()
        .map(|p| (format!("policy/{}", p.name_any()), p.uid()))
        .chain(
            bindings
                .items
                .iter()
                .map(|b| (format!("binding/{}", b.name_any()), b.uid())),
        );
    named
        .filter(|(name, _)| name.contains("/gpuhealth-"))
        .map(|(name, uid)| (name, uid.unwrap_or_default()))
        .collect()
}

/// `(kind, namespace, name)` of every object the release's manifest holds.
async fn release_objects() -> Vec<(String, String, String)> {
    let manifest = helm(&["get", "manifest", RELEASE, "--namespace", NAMESPACE])
        .await
        .expect("helm get manifest");
    serde_yaml::Deserializer::from_str(&manifest)
        .filter_map(|doc| serde_yaml::Value::deserialize(doc).ok())
        .filter(|object| object.get("kind").is_some())
        .map(|object| {
            let field = |path: &[&str]| {
                path.iter()
                    .try_fold(&object, |v, key| v.get(*key))
                    .and_then(|v| v.as_str())
                    .unwrap_or_default()
                    .to_owned()
            };
            (
                field(&["kind"]),
                field(&["metadata", "namespace"]),
                field(&["metadata", "name"]),
            )
        })
        .collect()
}

/// The executor DaemonSet's reboot flag and image, once its rollout is done.
async fn executor_rolled_out(admin: &Client) -> (String, String) {
    let executor = wait::until(
        Api::<DaemonSet>::namespaced(admin.clone(), NAMESPACE),
        "gpuhealth-executor",
        WAIT,
        |ds| {
            let status = ds.status.as_ref();
            status.is_some_and(|s| {
                s.observed_generation == ds.metadata.generation
                    && s.updated_number_scheduled == Some(s.desired_number_scheduled)
                    && s.number_ready == s.desired_number_scheduled
                    && s.desired_number_scheduled > 0
            })
        },
    )
    .await
    .expect("the executor rolled out");
    let container = executor
        .spec
        .and_then(|s| s.template.spec)
        .and_then(|s| s.containers.into_iter().next())
        .expect("its container");
    let reboot = container
        .args
        .unwrap_or_default()
        .into_iter()
        .find(|a| a.starts_with("--reboot-method="))
        .expect("a reboot method");
    (reboot, container.image.unwrap_or_default())
}

#[tokio::test]
async fn helm_install_upgrade_mid_remediation_and_uninstall() {
    let admin = client().await.expect("client");
    let (mut s, cpu) = Scenario::for_an_install("helm").await.expect("scenario");
    let node = s.nodes[0].clone();
    let nodes: Api<Node> = Api::all(admin.clone());
    let chart = packaged(&s.group).await;

    // A namespace whose Pod Security would refuse the agent's pods is
    // refused at install, before any of the release's objects is made
    // (Helm installs the CRDs first; --force-conflicts as below).
    let namespaces: Api<Namespace> = Api::all(admin.clone());
    let strict = format!("{}-baseline", s.group);
    let labelled: Namespace = serde_json::from_value(serde_json::json!({
        "metadata": {"name": strict, "labels": {"pod-security.kubernetes.io/enforce": "baseline"}},
    }))
    .expect("namespace");
    namespaces
        .create(&PostParams::default(), &labelled)
        .await
        .expect("a baseline namespace");
    let refused = helm(&[
        "install",
        RELEASE,
        &chart,
        "--namespace",
        &strict,
        "--force-conflicts",
    ])
    .await
    .expect_err("an install where the agent's pods would be refused");
    assert!(
        refused
            .to_string()
            .contains(r#"enforces Pod Security "baseline"; the agent needs "privileged""#),
        "{refused}"
    );
    let _ = namespaces.delete(&strict, &DeleteParams::default()).await;

    // --take-ownership: other files on this cluster applied config/ with
    // kubectl; the chart takes over what they left, as a user moving from
    // the kustomize install to the chart would. --force-conflicts: the
    // harness applied the same CRDs as its own field manager.
    helm(&[
        "install",
        RELEASE,
        &chart,
        "--namespace",
        NAMESPACE,
        "--create-namespace",
        "--take-ownership",
        "--force-conflicts",
        "--wait",
        "--timeout=4m",
    ])
    .await
    .expect("helm install");
    wait::until_set(
        Api::<Pod>::namespaced(admin.clone(), NAMESPACE),
        watcher::Config::default().fields(&format!("spec.nodeName={node}")),
        "the reporter's and the executor's pods on the GPU node",
        WAIT,
        |pods| pods.values().filter(|p| pod_is_ready(p)).count() == 2,
    )
    .await
    .expect("both agent DaemonSets run on the GPU node");
    let (reboot, image) = executor_rolled_out(&admin).await;
    assert_eq!(reboot, "--reboot-method=logind");
    let version = env!("CARGO_PKG_VERSION");
    assert!(image.ends_with(&format!(":{version}")), "{image}");

    let mut recorder = Recorder::start(&s.client, &s.group, &s.namespace);
    recorder.ready().await.expect("the recorder lists");

    // The operator on the chart's ServiceAccount, in the release's
    // namespace; the agent binary on the node.
    let token = identities::token(&admin, NAMESPACE, "gpuhealth-operator", None)
        .await
        .expect("a token for the chart's operator ServiceAccount");
    let kubeconfig = std::env::temp_dir().join(format!("{}-operator.kubeconfig", s.group));
    s.operator_options = Options {
        kubeconfig: Some(
            kubeconfig_with_token(&token, &kubeconfig)
                .await
                .expect("kubeconfig"),
        ),
        namespace: Some(NAMESPACE.into()),
        admission_check: Some(std::time::Duration::from_secs(2)),
        guardrails: Some(Vec::new()),
        ..Default::default()
    };
    s.start_with_agent_binaries()
        .await
        .expect("operator and agent");
    let ready = wait::until(
        Api::<GpuHealthPolicy>::all(admin.clone()),
        &s.policy,
        WAIT,
        |p| {
            p.status
                .as_ref()
                .is_some_and(|st| st.conditions.iter().any(|c| c.reason == "Managing"))
        },
    )
    .await;
    ready.expect("the policy Managing: the chart's admission policies found in force");

    s.break_gpu(&node, 7).await.expect("break");
    s.wait_recovered(&node).await.expect("the first incident");

    // The second incident, held in its drain by a budget that allows no
    // disruption, and the upgrade while it is held there.
    s.add_pdb("hold", 0)
        .await
        .expect("a budget that holds the drain");
    s.break_gpu(&node, 3).await.expect("break again");
    s.wait_status(&node, "draining, held by the budget", |st| {
        st.phase == Phase::Draining
    })
    .await
    .expect("mid-remediation");
    let guarded = admission_objects(&admin).await;
    assert_eq!(
        guarded.len(),
        18,
        "nine policies, nine bindings: {guarded:?}"
    );
    helm(&[
        "upgrade",
        RELEASE,
        &chart,
        "--namespace",
        NAMESPACE,
        "--reuse-values",
        "--set",
        "agent.rebootMethod=none",
        "--set",
        "agent.image.tag=0.1.1",
        "--wait",
        "--timeout=4m",
    ])
    .await
    .expect("helm upgrade");
    s.roll_agents_to(None).await.expect("the agents rolled");
    let (reboot, image) = executor_rolled_out(&admin).await;
    assert_eq!(reboot, "--reboot-method=none");
    assert!(image.ends_with(":0.1.1"), "{image}");
    assert_eq!(
        admission_objects(&admin).await,
        guarded,
        "every policy and binding patched in place"
    );
    let held = s
        .wait_status(&node, "still draining", |_| true)
        .await
        .expect("status");
    assert_eq!(held.phase, Phase::Draining, "{held:?}");
    Api::<PodDisruptionBudget>::namespaced(s.client.clone(), &s.namespace)
        .delete("hold", &DeleteParams::default())
        .await
        .expect("the budget lifted");
    s.wait_recovered(&node)
        .await
        .expect("the second incident, across the upgrade");

    let violations = invariants::check(
        &recorder.since(0),
        &Expectations {
            max_concurrent: [(s.policy.clone(), 1)].into(),
            sick: [(node.clone(), Phase::Healthy)].into(),
            ..Default::default()
        },
    );
    assert!(violations.is_empty(), "{violations:#?}");

    // Uninstall: the processes first (they are the pods here), then the
    // release. What Helm keeps by rule stays; nothing else does.
    if let Some(mut operator) = s.operator.take() {
        operator.kill().await;
    }
    let installed = release_objects().await;
    assert!(installed.len() > 30, "{installed:?}");
    helm(&[
        "uninstall",
        RELEASE,
        "--namespace",
        NAMESPACE,
        "--wait",
        "--timeout=4m",
    ])
    .await
    .expect("helm uninstall");
    for (kind, namespace, name) in &installed {
        let mut args = vec!["get", kind.as_str(), name.as_str(), "--ignore-not-found"];
        if !namespace.is_empty() {
            args.extend(["--namespace", namespace.as_str()]);
        }
        let left = kubectl(&args).await.expect("kubectl get");
        assert!(
            left.trim().is_empty(),
            "{kind} {namespace}/{name} left:\n{left}"
        );
    }
    for crd in [
        "gpuhealthpolicies.gpuhealth.io",
        "gpunodehealths.gpuhealth.io",
    ] {
        kubectl(&["get", "crd", crd])
            .await
            .unwrap_or_else(|e| panic!("the CRD {crd} kept: {e}"));
    }
    Api::<GpuHealthPolicy>::all(admin.clone())
        .get(&s.policy)
        .await
        .expect("the policy kept");
    namespaces.get(NAMESPACE).await.expect("the namespace kept");
    let _ = namespaces.delete(NAMESPACE, &DeleteParams::default()).await;
    let _ = nodes.delete(&cpu, &DeleteParams::default()).await;
}
