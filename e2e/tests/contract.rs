//! The annotation contract as a third party reads it: the worked example of
//! `docs/annotations.md`, played as written by a detector and an executor
//! made here from the docs alone (the executor keys on request ids and
//! nothing else), on two nodes that fail in the same second.

use std::sync::{Arc, Mutex};

use futures::StreamExt;
use gpuhealth_api::{
    GpuNodeHealth, RecoveryAction,
    contract::{
        CORDONED_BY_ANNOTATION, GPU_REPORT_ANNOTATION, REQUEST_RESULT_ANNOTATION,
        RESET_REQUEST_ANNOTATION,
    },
    node_health::Phase,
    vocabulary::{Attempt, AttemptOutcome},
};
use gpuhealth_e2e::{
    dra, reports,
    scenario::{Scenario, WAIT},
    sim::{SIM_GROUP_LABEL, is_cordoned},
    wait::{Background, applied, until},
};
use k8s_openapi::{
    api::core::v1::Node,
    apimachinery::pkg::{apis::meta::v1::Time, util::intstr::IntOrString},
    jiff::Timestamp,
};
use kube::{
    Api, Client, ResourceExt,
    api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams},
    runtime::watcher,
};
use serde_json::{Value, json};

const DOCS: &str = include_str!("../../docs/annotations.md");

/// One value of the worked example: the annotation it is written to.
struct Step {
    annotation: String,
    value: Value,
}

/// The JSON blocks of the docs' worked example, each with the last
/// annotation the text before it names.
fn worked_example() -> Vec<Step> {
    let start = DOCS
        .find("### A worked example")
        .expect("the docs have a worked example");
    let section = &DOCS[start + 1..];
    let section = &section[..section.find("\n### ").unwrap_or(section.len())];
    let mut steps = Vec::new();
    let mut rest = section;
    while let Some(open) = rest.find("```json\n") {
        let prose = &rest[..open];
        let annotation = prose
            .split('`')
            .rfind(|t| t.starts_with("gpuhealth.io/"))
            .expect("the text before each value names its annotation")
            .to_owned();
        let body = &rest[open + "```json\n".len()..];
        let close = body.find("```").expect("a closed block");
        let value = serde_json::from_str(&body[..close]).expect("the example's JSON parses");
        steps.push(Step { annotation, value });
        rest = &body[close + 3..];
    }
    steps
}

/// `value` with every time in it set to `now`: the example's times are of
/// its day, the run's are of this one.
fn stamped(value: &Value, now: &Value) -> Value {
    match value {
        Value::String(s) if s.parse::<Timestamp>().is_ok() => now.clone(),
        Value::Array(a) => Value::Array(a.iter().map(|v| stamped(v, now)).collect()),
        Value::Object(o) => Value::Object(
            o.iter()
                .map(|(k, v)| (k.clone(), stamped(v, now)))
                .collect(),
        ),
        other => other.clone(),
    }
}

fn now() -> Value {
    serde_json::to_value(Time(Timestamp::now())).expect("a time")
}

/// An id's parts, with the variable ones named by what they are: the docs'
/// example ids and the operator's must have the same.
fn shape(id: &str) -> Vec<String> {
    id.split('-')
        .map(|part| {
            if part.len() == 12 && part.chars().all(|c| c.is_ascii_hexdigit()) {
                "<12 hex>".to_owned()
            } else if part.len() >= 9 && part.chars().all(|c| c.is_ascii_digit()) {
                "<seconds>".to_owned()
            } else {
                part.to_owned()
            }
        })
        .collect()
}

fn keys(value: &Value) -> Vec<&String> {
    value
        .as_object()
        .map(|o| o.keys().collect())
        .unwrap_or_default()
}

async fn annotate(client: &Client, node: &str, annotation: &str, value: &Value) {
    let patch = json!({"metadata": {"annotations": {annotation: value.to_string()}}});
    Api::<Node>::all(client.clone())
        .patch(node, &PatchParams::default(), &Patch::Merge(patch))
        .await
        .expect("an annotation written");
}

/// The executor, from the docs: for each request id it has not carried out
/// (on any node: the id alone is the key), the check of step 3 of "A
/// request's life" (the request in flight, fenced for its incident), then
/// a fresh report, then the result. What it refused, and why, is kept.
fn executor(client: Client, group: &str, well: Value, result: Value) -> (Background, Served) {
    let served = Served::default();
    let task = {
        let served = served.clone();
        let config = watcher::Config::default().labels(&format!("{SIM_GROUP_LABEL}={group}"));
        Background::spawn(async move {
            let records: Api<DynamicObject> =
                Api::all_with(client.clone(), &ApiResource::from_gvk(&gnh_kind()));
            let mut nodes = std::pin::pin!(applied(Api::<Node>::all(client.clone()), config));
            while let Some(node) = nodes.next().await {
                let Some(request) = node
                    .annotations()
                    .get(RESET_REQUEST_ANNOTATION)
                    .and_then(|v| serde_json::from_str::<Value>(v).ok())
                else {
                    continue;
                };
                let Some(id) = request["id"].as_str().map(str::to_owned) else {
                    continue;
                };
                if served.done(&id) {
                    continue;
                }
                let name = node.name_any();
                let record = records
                    .get_opt(&name)
                    .await
                    .ok()
                    .flatten()
                    .and_then(|r| serde_json::to_value(r).ok())
                    .unwrap_or_default();
                if let Err(why) = in_flight_and_fenced(&record, &node, &request) {
                    served.refused(&id, why);
                    continue;
                }
                served.carried_out(&id);
                annotate(
                    &client,
                    &name,
                    GPU_REPORT_ANNOTATION,
                    &stamped(&well, &now()),
                )
                .await;
                let mut answer = stamped(&result, &now());
                answer["id"] = json!(id);
                annotate(&client, &name, REQUEST_RESULT_ANNOTATION, &answer).await;
            }
        })
    };
    (task, served)
}

fn gnh_kind() -> GroupVersionKind {
    GroupVersionKind::gvk("gpuhealth.io", "v1alpha1", "GpuNodeHealth")
}

/// Step 3 of "A request's life", as written: `request` is the one the
/// node's `GpuNodeHealth` records in flight, and it is fenced for the
/// incident, the node cordoned or each GPU it names fenced alone.
fn in_flight_and_fenced(record: &Value, node: &Node, request: &Value) -> Result<(), String> {
    let status = &record["status"];
    let action = &status["action"];
    if action["id"] != request["id"] || status["phase"] != "Remediating" {
        return Err(format!(
            "not in flight: {} in phase {}",
            action["id"], status["phase"]
        ));
    }
    if action["type"] != "GpuReset" || action["gpus"] != request["gpus"] {
        return Err(format!("not as asked: {action}"));
    }
    let incident = &status["incident"];
    let cordon_record = node
        .annotations()
        .get(CORDONED_BY_ANNOTATION)
        .and_then(|v| serde_json::from_str::<Value>(v).ok());
    let closed = |i: &Value| {
        status["history"]
            .as_array()
            .is_some_and(|h| h.iter().any(|x| &x["id"] == i && !x["outcome"].is_null()))
    };
    let cordoned = node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true)
        && cordon_record.is_none_or(|r| &r["incident"] == incident || closed(&r["incident"]));
    let quarantine = &status["quarantine"];
    let fenced: Vec<&Value> = quarantine["gpus"]
        .as_array()
        .map(|g| g.iter().map(|g| &g["uuid"]).collect())
        .unwrap_or_default();
    let alone = quarantine["scope"] == "Gpu"
        && quarantine["liftedAt"].is_null()
        && &quarantine["incident"] == incident
        && request["gpus"]
            .as_array()
            .is_some_and(|g| !g.is_empty() && g.iter().all(|g| fenced.contains(&g)));
    if cordoned || alone {
        Ok(())
    } else {
        Err(format!("not fenced: quarantine {quarantine}"))
    }
}

/// The ids the executor carried out, and those it refused with why.
#[derive(Clone, Default)]
struct Served(Arc<Mutex<Ledger>>);

#[derive(Default)]
struct Ledger {
    carried: Vec<String>,
    /// Each refused id, with why.
    refused: Vec<(String, String)>,
}

impl Served {
    fn done(&self, id: &str) -> bool {
        self.0
            .lock()
            .is_ok_and(|s| s.carried.iter().any(|d| d == id))
    }

    fn carried_out(&self, id: &str) {
        if let Ok(mut s) = self.0.lock() {
            s.carried.push(id.to_owned());
        }
    }

    fn refused(&self, id: &str, why: String) {
        if let Ok(mut s) = self.0.lock() {
            s.refused.push((id.to_owned(), why));
        }
    }

    fn carried(&self) -> Vec<String> {
        self.0.lock().map(|s| s.carried.clone()).unwrap_or_default()
    }

    fn refusals(&self) -> Vec<(String, String)> {
        self.0.lock().map(|s| s.refused.clone()).unwrap_or_default()
    }
}

/// Every value the watched nodes' annotations took, in order, so that a
/// value the operator wrote and then removed can be read after the fact.
#[derive(Clone, Default)]
struct Written(Arc<Mutex<Vec<(String, String, String)>>>);

impl Written {
    fn watch(&self, client: Client, group: &str) -> Background {
        let all = self.0.clone();
        let config = watcher::Config::default().labels(&format!("{SIM_GROUP_LABEL}={group}"));
        Background::spawn(async move {
            let mut nodes = std::pin::pin!(applied(Api::<Node>::all(client), config));
            while let Some(node) = nodes.next().await {
                let Ok(mut all) = all.lock() else { return };
                for (key, value) in node.annotations() {
                    let seen = (node.name_any(), key.clone(), value.clone());
                    if !all.contains(&seen) {
                        all.push(seen);
                    }
                }
            }
        })
    }

    /// The first value of `annotation` on `node` that mentions `text`, as JSON.
    fn first(&self, node: &str, annotation: &str, text: &str) -> Option<Value> {
        let all = self.0.lock().ok()?;
        all.iter()
            .find(|(n, a, v)| n == node && a == annotation && v.contains(text))
            .and_then(|(_, _, v)| serde_json::from_str(v).ok())
    }
}

/// The second an incident id names.
fn second_of(incident: &str) -> &str {
    incident.split('-').nth(1).unwrap_or_default()
}

#[tokio::test]
async fn the_worked_example_plays_on_two_nodes_failing_in_the_same_second() {
    let steps = worked_example();
    let written: Vec<&str> = steps.iter().map(|s| s.annotation.as_str()).collect();
    assert_eq!(
        written,
        [
            GPU_REPORT_ANNOTATION,
            CORDONED_BY_ANNOTATION,
            RESET_REQUEST_ANNOTATION,
            GPU_REPORT_ANNOTATION,
            REQUEST_RESULT_ANNOTATION,
        ],
        "the example's steps"
    );
    let [sick, record, request, well, result] = [0, 1, 2, 3, 4].map(|i| steps[i].value.clone());

    let mut spec = Scenario::quick_spec();
    spec.max_concurrent = IntOrString::Int(2);
    spec.max_unhealthy = IntOrString::String("100%".into());
    // A round may be played again on the same GPUs at once.
    spec.remediation_limits.cooldown = gpuhealth_api::Duration::from_secs(0);
    spec.remediation_limits.per_gpu = 10;
    spec.remediation_limits.per_node = 10;
    let mut s = Scenario::new("contract", 2, spec).await.expect("scenario");
    s.start_operator().await.expect("operator");
    let written = Written::default();
    let _recorder = written.watch(s.client.clone(), &s.group);
    let (_executor, served) = executor(s.client.clone(), &s.group, well, result);
    let health: Api<GpuNodeHealth> = Api::all(s.client.clone());

    // The operator decides on the second it sees a report in: both reports
    // go out as a second starts, and a round whose incidents straddle two
    // seconds is played to its end and tried again.
    let mut before: Vec<String> = Vec::new();
    for round in 1..=3 {
        let into_second = Timestamp::now().subsec_nanosecond();
        tokio::time::sleep(std::time::Duration::from_nanos(
            1_000_000_000 - u64::try_from(into_second).unwrap_or(0),
        ))
        .await;
        let report = stamped(&sick, &now());
        futures::future::join_all(
            s.nodes
                .iter()
                .map(|n| annotate(&s.client, n, GPU_REPORT_ANNOTATION, &report)),
        )
        .await;
        let mut incidents = Vec::new();
        for node in &s.nodes {
            let g = until(health.clone(), node, WAIT, |g| {
                g.status
                    .as_ref()
                    .and_then(|st| st.incident.as_ref())
                    .is_some_and(|i| !before.contains(i))
            })
            .await
            .expect("an incident opens");
            incidents.extend(g.status.and_then(|st| st.incident));
        }
        before.extend(incidents.iter().cloned());
        let same_second = second_of(&incidents[0]) == second_of(&incidents[1]);
        if !same_second && round < 3 {
            eprintln!("round {round}: {incidents:?} straddle two seconds; again");
            for node in &s.nodes {
                s.wait_recovered(node).await.expect("recovers");
            }
            continue;
        }
        assert!(same_second, "three rounds straddled seconds: {incidents:?}");
        assert_ne!(incidents[0], incidents[1], "one id per node");

        // Step 5 first: each node back in service after one reset, which
        // the executor carried out.
        for node in &s.nodes {
            let status = s.wait_recovered(node).await.expect("recovers");
            assert_eq!(status.phase, Phase::Healthy);
            assert_eq!(
                status.history[0].attempts,
                [Attempt::new(
                    RecoveryAction::GpuReset,
                    1,
                    AttemptOutcome::Succeeded
                )],
                "one reset, no reboot: the executor served this node too"
            );
            let n = s.node(node).await.expect("node");
            assert!(!is_cordoned(&n), "uncordoned");
            assert!(!n.annotations().contains_key(CORDONED_BY_ANNOTATION));
        }
        // Steps 2 and 3 as the operator wrote them, against the docs.
        let mut ids = Vec::new();
        for (node, incident) in s.nodes.iter().zip(&incidents) {
            let reset_id = format!("{incident}-reset-1");
            let cordon = written
                .first(node, CORDONED_BY_ANNOTATION, incident)
                .expect("step 2: the cordon's record");
            assert_eq!(keys(&cordon), keys(&record), "{cordon}");
            assert_eq!(cordon["incident"], json!(incident));
            assert_eq!(
                shape(incident),
                shape(record["incident"].as_str().unwrap_or_default()),
                "the incident id as the docs show it"
            );
            let asked = written
                .first(node, RESET_REQUEST_ANNOTATION, &reset_id)
                .expect("step 3: the reset request");
            assert_eq!(keys(&asked), keys(&request), "{asked}");
            assert_eq!(asked["gpus"], request["gpus"], "GPU 7 by its UUID");
            assert_eq!(
                shape(&reset_id),
                shape(request["id"].as_str().unwrap_or_default()),
                "the request id as the docs show it"
            );
            let n = s.node(node).await.expect("node");
            assert!(
                n.annotations()
                    .get(RESET_REQUEST_ANNOTATION)
                    .is_some_and(|v| v.contains(&reset_id)),
                "the request stays, as the docs say"
            );
            ids.push(reset_id);
        }
        assert_ne!(ids[0], ids[1], "one request id per node");
        assert_eq!(served.refusals(), [], "the docs' check passed");
        let served = served.carried();
        for id in &ids {
            assert_eq!(
                served.iter().filter(|s| *s == id).count(),
                1,
                "{id} carried out once: {served:?}"
            );
        }
        return;
    }
}

/// A reset on a DRA node, its bad GPU fenced alone and the node never
/// cordoned: the executor's check from the docs lets it through on the
/// quarantine record, and carries it out once.
#[tokio::test]
async fn a_reset_of_a_gpu_fenced_alone_passes_the_executors_check_from_the_docs() {
    let steps = worked_example();
    let result = steps[4].value.clone();
    let mut s = Scenario::new_dra("contract-dra", 1, Scenario::quick_spec())
        .await
        .expect("scenario");
    let node = s.nodes[0].clone();
    dra::claiming_pod(&s.client, &s.namespace, &s.group, "holder-7", Some(7))
        .await
        .expect("a pod claiming GPU 7");
    s.start_operator().await.expect("operator");
    let well = serde_json::to_value(reports::healthy(&s.namespace, &[])).expect("a report");
    let (_executor, served) = executor(s.client.clone(), &s.group, well, result);

    let mut sick = reports::healthy(&s.namespace, &[]);
    reports::xid_119_and_154(&mut sick, 7);
    s.write_report(&node, sick).await.expect("report");
    let status = s.wait_recovered(&node).await.expect("recovers");
    assert_eq!(
        status.history[0].attempts,
        [Attempt::new(
            RecoveryAction::GpuReset,
            1,
            AttemptOutcome::Succeeded
        )],
        "one reset, carried out by the executor"
    );
    let q = status.quarantine.expect("the quarantine's record");
    assert_eq!(q.incident, status.history[0].id, "fenced for the incident");
    let n = s.node(&node).await.expect("node");
    assert!(!is_cordoned(&n), "fenced GPU by GPU, never cordoned");
    assert!(!n.annotations().contains_key(CORDONED_BY_ANNOTATION));
    assert_eq!(served.refusals(), [], "the docs' check passed");
    assert_eq!(
        served.carried(),
        [format!("{}-reset-1", status.history[0].id)]
    );
}

#[test]
fn the_worked_example_reads_as_the_contract_types() {
    use gpuhealth_api::contract::{
        AnnotationValue, CordonRecord, GpuReport, RequestResult, ResetRequest,
    };
    let steps = worked_example();
    assert_eq!(steps.len(), 5, "five values in the example");
    for step in &steps {
        let raw = step.value.to_string();
        let read = match step.annotation.as_str() {
            GPU_REPORT_ANNOTATION => GpuReport::parse(&raw)
                .map(|_| ())
                .map_err(|e| e.to_string()),
            CORDONED_BY_ANNOTATION => CordonRecord::parse(&raw)
                .map(|_| ())
                .map_err(|e| e.to_string()),
            RESET_REQUEST_ANNOTATION => ResetRequest::parse(&raw)
                .map(|_| ())
                .map_err(|e| e.to_string()),
            REQUEST_RESULT_ANNOTATION => RequestResult::parse(&raw)
                .map(|_| ())
                .map_err(|e| e.to_string()),
            other => Err(format!("{other} is not an annotation of the contract")),
        };
        assert!(read.is_ok(), "{}: {read:?}", step.annotation);
    }
    // The ids the example names are the ones the operator would give.
    let incident = steps[1].value["incident"].as_str().unwrap_or_default();
    assert_eq!(
        incident,
        gpuhealth_api::contract::RequestId::for_incident("gpu-node-7", 1_780_042_543).as_str()
    );
    assert_eq!(
        steps[2].value["id"],
        json!(format!("{incident}-reset-1")),
        "the request names its incident"
    );
}
