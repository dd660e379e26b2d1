//! The committed CRD YAML, in `crds/` and in the chart's `crds/`, is
//! exactly what the Rust types generate; run `make crds` after changing the
//! API.

use std::{fs, path::Path};

use gpuhealth_api::{GpuHealthPolicySpec, crds};

#[test]
fn committed_crds_match_the_generated_ones() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    for dir in ["crds", "charts/gpuhealth/crds"] {
        for (file, generated) in crds::rendered().expect("CRDs render") {
            let committed = fs::read_to_string(root.join(dir).join(file)).unwrap_or_default();
            assert!(
                committed == generated,
                "{dir}/{file} is out of date: run `make crds` and commit the result"
            );
        }
    }
    let committed = fs::read_to_string(root.join("crds/kustomization.yaml")).unwrap_or_default();
    assert!(
        committed == crds::kustomization(),
        "crds/kustomization.yaml is out of date: run `make crds` and commit the result"
    );
}

#[test]
fn a_selector_only_policy_deserialises_to_the_documented_defaults() {
    let spec: GpuHealthPolicySpec =
        serde_json::from_str(r#"{"nodeSelector": {"matchLabels": {"gpu": "true"}}}"#)
            .expect("minimal spec");
    let expected = GpuHealthPolicySpec::for_selector(spec.node_selector.clone());
    assert_eq!(spec, expected);
}

#[test]
fn every_schema_default_matches_the_rust_default() {
    // The CRD's defaults are generated from the serde defaults; the spec
    // default of each top-level field must equal the Rust value.
    let crd = serde_json::to_value(&crds::all()[0]).expect("crd");
    let props = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"];
    let defaults =
        serde_json::to_value(GpuHealthPolicySpec::for_selector(Default::default())).expect("spec");
    for field in [
        "mode",
        "priority",
        "detection",
        "escalation",
        "drain",
        "maxConcurrent",
        "maxUnhealthy",
        "verification",
    ] {
        assert_eq!(
            props[field]["default"], defaults[field],
            "schema default of spec.{field}"
        );
    }
}

#[test]
fn committed_reference_matches_the_crd_schemas() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/reference.md");
    let committed = fs::read_to_string(path).unwrap_or_default();
    assert!(
        committed == gpuhealth_api::reference::markdown(),
        "docs/reference.md is out of date: run `make docs` and commit the result"
    );
}
