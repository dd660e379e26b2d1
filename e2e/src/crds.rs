//! Installing gpuhealth's CRDs the way a user would, and waiting until the
//! API server serves them.

use std::time::Duration;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::{
    Api, Client, ResourceExt,
    api::{Patch, PatchParams},
    runtime::{conditions, wait::await_condition},
};

use crate::{Result, wait::within};

/// Server-side applies both CRDs and waits until each is Established.
pub async fn install(client: &Client) -> Result<()> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let params = PatchParams::apply("gpuhealth-e2e").force();
    for crd in gpuhealth_api::crds::all() {
        let name = crd.name_any();
        api.patch(&name, &params, &Patch::Apply(&crd)).await?;
        within(
            &format!("CRD {name} Established"),
            Duration::from_secs(60),
            async {
                await_condition(api.clone(), &name, conditions::is_crd_established())
                    .await
                    .map_err(|e| crate::HarnessError::ClusterStart(e.to_string()))
            },
        )
        .await?;
    }
    Ok(())
}
