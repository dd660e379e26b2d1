//! What the operator's ServiceAccount may do: `config/rbac` applied to the
//! real API server, and the operator binary run with that account's own
//! token through the incident. Everything it needs is allowed (its log has
//! no refusal in it); what it must never do is refused.

use gpuhealth_e2e::{
    client,
    cluster::{client_with_token, kubeconfig_with_token},
    kubectl,
    operator::{self, Options},
    scenario::Scenario,
};
use k8s_openapi::api::{
    apps::v1::Deployment,
    authentication::v1::{TokenRequest, TokenRequestSpec},
    coordination::v1::Lease,
    core::v1::{Node, Pod, Secret, ServiceAccount},
};
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams, Patch, PatchParams, PostParams},
};
use serde_json::json;

const NAMESPACE: &str = "gpuhealth-system";
const ACCOUNT: &str = "gpuhealth-operator";

async fn apply(dir: &str) {
    let path = format!("{}/../config/{dir}", env!("CARGO_MANIFEST_DIR"));
    kubectl(&["apply", "--server-side", "-k", &path])
        .await
        .unwrap_or_else(|e| panic!("kubectl apply -k config/{dir}: {e}"));
}

async fn token(admin: &Client) -> String {
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: None,
            bound_object_ref: None,
            expiration_seconds: Some(3600),
        }),
        ..Default::default()
    };
    let accounts: Api<ServiceAccount> = Api::namespaced(admin.clone(), NAMESPACE);
    let answer: TokenRequest = accounts
        .create_subresource("token", ACCOUNT, &PostParams::default(), &request)
        .await
        .expect("a token for the operator's ServiceAccount");
    answer.status.and_then(|s| s.token).expect("the token")
}

fn refused<T: std::fmt::Debug>(what: &str, result: Result<T, kube::Error>) {
    match result {
        Err(kube::Error::Api(s)) if s.code == 403 => {}
        other => panic!("{what} must be refused (403): {other:?}"),
    }
}

#[tokio::test]
async fn the_operator_runs_the_incident_on_its_own_rights_and_no_more() {
    let admin = client().await.expect("client");
    apply("namespace").await;
    apply("rbac").await;
    let token = token(&admin).await;

    let mut s = Scenario::new("operator-rbac", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
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
            ..Default::default()
        },
    )
    .await
    .expect("operator");
    s.operator = Some(operator);
    s.wait_taken_in().await.expect("taken in");

    // The incident, end to end: watch, cordon, evict behind a PDB, request,
    // verify, uncordon, Events, statuses, the Lease, the workload check.
    s.break_gpu(&node, 7).await.expect("break");
    s.wait_recovered(&node)
        .await
        .expect("recovered as the ServiceAccount");
    s.wait_workloads_judged(&node).await.expect("judged");
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
    refused(
        "deleting a pod (force-delete is opt-in: config/rbac-force-delete)",
        Api::<Pod>::namespaced(sa.clone(), &s.namespace)
            .delete(&pods[0], &DeleteParams::default())
            .await,
    );
    refused(
        "creating a pod outside its namespace",
        Api::<Pod>::namespaced(sa.clone(), &s.namespace)
            .create(
                &PostParams::default(),
                &serde_json::from_value(json!({
                    "metadata": {"name": "not-allowed"},
                    "spec": {"containers": [{"name": "c", "image": "x"}]},
                }))
                .expect("pod"),
            )
            .await,
    );
}
