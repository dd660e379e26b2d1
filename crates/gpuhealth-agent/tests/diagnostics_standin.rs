//! The executor's diagnostic carried out against the dcgmi stand-in
//! (`e2e/dcgmi-standin/dcgmi`, Python 3), as a real node runs NVIDIA's:
//! UUIDs to indices through the backend, dcgmi by path under its budget,
//! its report into the answer.
//!
//! One test, run in a binary of its own: it writes an executable and runs
//! it, which a concurrent fork elsewhere in the binary could make fail with
//! "text file busy".

use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use gpuhealth_agent::{
    backend::Backend,
    diagnostics::{self, Dcgm, Diagnosed, MARGIN},
    done::Done,
};
use gpuhealth_api::contract::{
    AnnotationValue, Capabilities, DiagnosticsLevel, DiagnosticsVerdict, GpuEntry, Outcome,
    RebootMethod, RequestResult, TestVerdict,
};
use k8s_openapi::{api::core::v1::Node, apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};

const STANDIN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../e2e/dcgmi-standin/dcgmi");
const GPU_A: &str = "GPU-0a1b2c3d";
const GPU_B: &str = "GPU-99aabbcc";

/// Two GPUs, at NVML indices 2 and 5.
struct TwoGpus;

impl Backend for TwoGpus {
    fn source(&self) -> &'static str {
        "test"
    }

    fn capabilities(&self, _node: &Node) -> Capabilities {
        Capabilities {
            reset: false,
            reboot: RebootMethod::None,
        }
    }

    async fn read(&mut self, _node: &Node) -> Result<Vec<GpuEntry>, String> {
        let entry = |index: u32, uuid: &str| {
            serde_json::from_value(serde_json::json!({
                "index": index,
                "uuid": uuid,
                "pciBusId": format!("0000:{index:02x}:00.0"),
                "health": "Healthy",
            }))
            .map_err(|e| e.to_string())
        };
        Ok(vec![entry(2, GPU_A)?, entry(5, GPU_B)?])
    }

    async fn reset(&mut self, _node: &Node, _id: &str, _gpus: &[String]) -> Done {
        (Outcome::Refused, "not here".into())
    }

    async fn reboot(&mut self, _node: &Node, _id: &str) -> Done {
        (Outcome::Refused, "not here".into())
    }
}

/// `dcgmi`: the stand-in, told what to do by `behaviour` (rewritten
/// before each run).
struct StandIn {
    dir: PathBuf,
    behaviour: PathBuf,
    dcgm: Dcgm,
}

impl StandIn {
    fn new() -> StandIn {
        let dir = std::env::temp_dir().join(format!("gpuhealth-diag-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a directory");
        let behaviour = dir.join("behaviour");
        let dcgmi = dir.join("dcgmi");
        std::fs::write(
            &dcgmi,
            format!(
                "#!/bin/sh\nGPUHEALTH_DCGMI_STANDIN_FILE='{}' exec '{STANDIN}' \"$@\"\n",
                behaviour.display()
            ),
        )
        .expect("write the wrapper");
        std::fs::set_permissions(&dcgmi, std::fs::Permissions::from_mode(0o755))
            .expect("make it executable");
        StandIn {
            dir,
            behaviour,
            dcgm: Dcgm { dcgmi, host: None },
        }
    }

    async fn diagnose(
        &mut self,
        behaviour: &str,
        level: DiagnosticsLevel,
        gpus: &[&str],
        budget: Duration,
    ) -> Diagnosed {
        std::fs::write(&self.behaviour, behaviour).expect("write the behaviour");
        let gpus: Vec<String> = gpus.iter().map(|g| (*g).to_owned()).collect();
        let deadline = Timestamp::now() + MARGIN + budget;
        let d = diagnostics::carry_out(
            &mut TwoGpus,
            &Node::default(),
            &self.dcgm,
            level,
            &gpus,
            deadline,
        )
        .await;
        // Every answer is one the operator accepts.
        let answer = RequestResult {
            id: "inc-1-reset-1-diagnostics".parse().expect("an id"),
            outcome: d.outcome,
            message: diagnostics::fit(&d.message, 1000),
            // To the second, as it is written.
            finished_at: Time(Timestamp::UNIX_EPOCH),
            diagnostics: Some(d.result.clone()),
        };
        assert_eq!(
            RequestResult::parse(&answer.to_annotation()),
            Ok(answer),
            "{behaviour}"
        );
        d
    }
}

impl Drop for StandIn {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn tests(d: &Diagnosed) -> Vec<(&str, Option<&str>, TestVerdict)> {
    d.result
        .tests
        .iter()
        .map(|t| (t.name.as_str(), t.gpu.as_deref(), t.verdict))
        .collect()
}

const BUDGET: Duration = Duration::from_secs(30);

#[tokio::test]
async fn the_standins_answers_become_the_executors() {
    let mut standin = StandIn::new();
    let both = [GPU_A, GPU_B];

    let pass = standin
        .diagnose("pass", DiagnosticsLevel::Medium, &both, BUDGET)
        .await;
    assert_eq!(
        (pass.outcome, pass.result.verdict),
        (Outcome::Succeeded, DiagnosticsVerdict::Pass)
    );
    assert_eq!(pass.result.dcgm_version.as_deref(), Some("4.2.3"));
    assert_eq!(pass.message, "6 tests passed");
    assert!(
        tests(&pass).contains(&("memory", Some(GPU_B), TestVerdict::Pass)),
        "{pass:?}"
    );

    // GPU B is index 5: only it fails.
    let fail = standin
        .diagnose("fail 5", DiagnosticsLevel::Medium, &both, BUDGET)
        .await;
    assert_eq!(
        (fail.outcome, fail.result.verdict),
        (Outcome::Failed, DiagnosticsVerdict::Fail)
    );
    let memory: Vec<_> = tests(&fail)
        .into_iter()
        .filter(|t| t.0 == "memory" && t.1.is_some())
        .collect();
    assert_eq!(
        memory,
        [
            ("memory", Some(GPU_A), TestVerdict::Pass),
            ("memory", Some(GPU_B), TestVerdict::Fail)
        ]
    );
    assert!(
        fail.message
            .starts_with(&format!("memory on {GPU_B}: Fail (GPU 5: memory read back")),
        "{}",
        fail.message
    );

    // DCGM 4.x writes a warning "Fail" and exits 226, as for a failure:
    // the parser reads it as one (only DCGM 3.x's exit 0 makes it a Warn).
    let warn = standin
        .diagnose("warn", DiagnosticsLevel::Quick, &[GPU_A], BUDGET)
        .await;
    assert_eq!(
        (warn.outcome, warn.result.verdict),
        (Outcome::Failed, DiagnosticsVerdict::Fail)
    );
    assert!(
        warn.message.contains("persistence mode is off"),
        "{}",
        warn.message
    );

    let started = Instant::now();
    let hang = standin
        .diagnose(
            "hang",
            DiagnosticsLevel::Quick,
            &[GPU_A],
            Duration::from_millis(1500),
        )
        .await;
    assert_eq!(
        (hang.outcome, hang.result.verdict),
        (Outcome::Failed, DiagnosticsVerdict::TimedOut)
    );
    assert!(hang.message.contains("was killed"), "{}", hang.message);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );

    // No time left: not run at all.
    let started = Instant::now();
    let late = standin
        .diagnose("hang", DiagnosticsLevel::Quick, &[GPU_A], Duration::ZERO)
        .await;
    assert_eq!(late.result.verdict, DiagnosticsVerdict::TimedOut);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );

    standin.dcgm.host = Some("10.0.0.7".into());
    let unreachable = standin
        .diagnose("unreachable", DiagnosticsLevel::Quick, &both, BUDGET)
        .await;
    assert_eq!(
        (unreachable.outcome, unreachable.result.verdict),
        (Outcome::Failed, DiagnosticsVerdict::Error)
    );
    assert!(
        unreachable.message.contains("10.0.0.7"),
        "{}",
        unreachable.message
    );
    standin.dcgm.host = None;

    let error = standin
        .diagnose("error", DiagnosticsLevel::Quick, &both, BUDGET)
        .await;
    assert_eq!(error.result.verdict, DiagnosticsVerdict::Error);
    assert!(
        error.message.contains("already running"),
        "{}",
        error.message
    );

    // A GPU not on the node: said so, dcgmi not run.
    let missing = standin
        .diagnose("pass", DiagnosticsLevel::Quick, &["GPU-deadbeef"], BUDGET)
        .await;
    assert_eq!(missing.result.verdict, DiagnosticsVerdict::Error);
    assert_eq!(missing.message, "no GPU GPU-deadbeef on this node");

    let absent = Dcgm {
        dcgmi: Path::new("/no/such/dcgmi").to_owned(),
        host: None,
    };
    standin.dcgm = absent;
    let no_dcgmi = standin
        .diagnose("pass", DiagnosticsLevel::Quick, &both, BUDGET)
        .await;
    assert_eq!(no_dcgmi.result.verdict, DiagnosticsVerdict::Error);
    assert_eq!(no_dcgmi.message, "no dcgmi at /no/such/dcgmi");
}
