//! Real identities for admission and RBAC tests: ServiceAccounts with the
//! rights a test names, and tokens for them from the API server, bound to a
//! pod where the test needs the node name a kubelet's token carries.

use k8s_openapi::api::{
    authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec},
    core::v1::{Pod, ServiceAccount},
    rbac::v1::{ClusterRole, ClusterRoleBinding, PolicyRule, RoleRef, Subject},
};
use kube::{
    Api, Client, ResourceExt,
    api::{ObjectMeta, Patch, PatchParams, PostParams},
};

use crate::{HarnessError, Result};

/// A token for `namespace/account`; bound to `pod` (and so carrying its
/// node's name, as the kubelet's projected token does) when given.
pub async fn token(
    admin: &Client,
    namespace: &str,
    account: &str,
    pod: Option<&Pod>,
) -> Result<String> {
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: None,
            bound_object_ref: pod.map(|pod| BoundObjectReference {
                kind: Some("Pod".into()),
                api_version: Some("v1".into()),
                name: Some(pod.name_any()),
                uid: pod.uid(),
            }),
            expiration_seconds: Some(600),
        }),
        ..Default::default()
    };
    let accounts: Api<ServiceAccount> = Api::namespaced(admin.clone(), namespace);
    let answer: TokenRequest = accounts
        .create_subresource("token", account, &PostParams::default(), &request)
        .await?;
    answer
        .status
        .and_then(|s| s.token)
        .ok_or_else(|| HarnessError::Invalid(format!("no token for {namespace}/{account}")))
}

/// A ServiceAccount `namespace/name` granted `rules` cluster-wide (a
/// ClusterRole and binding of the same name), and a client that is it.
pub async fn account_with(
    admin: &Client,
    namespace: &str,
    name: &str,
    rules: Vec<PolicyRule>,
) -> Result<Client> {
    let params = PatchParams::apply("gpuhealth-e2e").force();
    let account = ServiceAccount {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            ..Default::default()
        },
        ..Default::default()
    };
    Api::<ServiceAccount>::namespaced(admin.clone(), namespace)
        .patch(name, &params, &Patch::Apply(&account))
        .await?;
    let role = ClusterRole {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        rules: Some(rules),
        ..Default::default()
    };
    Api::<ClusterRole>::all(admin.clone())
        .patch(name, &params, &Patch::Apply(&role))
        .await?;
    bind(admin, namespace, name, name, name).await?;
    crate::cluster::client_with_token(&token(admin, namespace, name, None).await?).await
}

/// Binds the ClusterRole `role` to `namespace/account` by a
/// ClusterRoleBinding named `binding`.
pub async fn bind(
    admin: &Client,
    namespace: &str,
    account: &str,
    role: &str,
    binding: &str,
) -> Result<()> {
    let name = binding;
    let binding = ClusterRoleBinding {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..Default::default()
        },
        role_ref: RoleRef {
            api_group: Some("rbac.authorization.k8s.io".into()),
            kind: "ClusterRole".into(),
            name: role.into(),
        },
        subjects: Some(vec![Subject {
            kind: "ServiceAccount".into(),
            name: account.into(),
            namespace: Some(namespace.into()),
            ..Default::default()
        }]),
    };
    Api::<ClusterRoleBinding>::all(admin.clone())
        .patch(
            name,
            &PatchParams::apply("gpuhealth-e2e").force(),
            &Patch::Apply(&binding),
        )
        .await?;
    Ok(())
}

/// A rule of `verbs` on `resources` of `group`.
pub fn rule(group: &str, resources: &[&str], verbs: &[&str]) -> PolicyRule {
    PolicyRule {
        api_groups: Some(vec![group.into()]),
        resources: Some(resources.iter().map(|r| (*r).to_owned()).collect()),
        verbs: verbs.iter().map(|v| (*v).to_owned()).collect(),
        ..Default::default()
    }
}
