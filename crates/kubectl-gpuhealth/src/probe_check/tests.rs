use gpuhealth_api::contract::{AnnotationValue, GpuReport};
use serde_json::{Value, json};

use super::*;

fn pod(name: &str, uid: &str, status: Value) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ml-serving",
            "uid": uid,
            "creationTimestamp": "2026-05-29T08:18:40Z",
            "labels": {"app": "vllm", "pod-template-hash": "7d9f6"},
            "ownerReferences": [{
                "apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "vllm-7d9f6",
                "uid": "rs-uid", "controller": true
            }]
        },
        "spec": {
            "nodeName": "192.168.1.1",
            "containers": [{
                "name": "vllm",
                "image": "vllm/vllm-openai",
                // The incident's probe: 30 s, then 30 tries of 10 s: 330 s.
                "startupProbe": {
                    "httpGet": {"path": "/health", "port": 8000},
                    "initialDelaySeconds": 30, "periodSeconds": 10,
                    "timeoutSeconds": 5, "failureThreshold": 30
                }
            }]
        },
        "status": status
    }))
    .expect("pod")
}

fn event(uid: &str, reason: &str, message: &str, at: &str) -> Event {
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": format!("vllm.{reason}"), "namespace": "ml-serving"},
        "involvedObject": {"kind": "Pod", "name": "vllm-7d9f6-k2x8p", "namespace": "ml-serving", "uid": uid},
        "reason": reason,
        "message": message,
        "type": "Warning",
        "source": {"component": "kubelet", "host": "192.168.1.1"},
        "firstTimestamp": at,
        "lastTimestamp": at
    }))
    .expect("event")
}

/// (a) The incident's vLLM after the reset: started at 08:19:00, killed by
/// its startup probe 331 s later, four times over.
fn looping() -> PodInput {
    PodInput {
        pod: pod(
            "vllm-7d9f6-k2x8p",
            "uid-1",
            json!({
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "False", "lastTransitionTime": "2026-05-29T08:18:45Z"}],
                "containerStatuses": [{
                    "name": "vllm", "image": "vllm/vllm-openai", "imageID": "", "ready": false,
                    "restartCount": 4,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {
                        "exitCode": 137, "reason": "Error",
                        "startedAt": "2026-05-29T08:19:00Z", "finishedAt": "2026-05-29T08:24:31Z"
                    }}
                }]
            }),
        ),
        events: vec![
            event(
                "uid-1",
                "Unhealthy",
                "Startup probe failed: Get \"http://10.0.0.7:8000/health\": dial tcp 10.0.0.7:8000: connect: connection refused",
                "2026-05-29T08:24:21Z",
            ),
            event(
                "uid-1",
                "Killing",
                "Container vllm failed startup probe, will be restarted",
                "2026-05-29T08:24:30Z",
            ),
        ],
        xids: Vec::new(),
    }
}

/// (b) A pod of the same workload that made it: Ready 200 s after start.
fn ready() -> PodInput {
    PodInput {
        pod: pod(
            "vllm-7d9f6-q8r4t",
            "uid-2",
            json!({
                "phase": "Running",
                "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-05-29T08:22:20Z"}],
                "containerStatuses": [{
                    "name": "vllm", "image": "vllm/vllm-openai", "imageID": "", "ready": true,
                    "restartCount": 0,
                    "state": {"running": {"startedAt": "2026-05-29T08:19:00Z"}}
                }]
            }),
        ),
        events: Vec::new(),
        xids: Vec::new(),
    }
}

/// (c) A pod still being created.
fn pending() -> PodInput {
    PodInput {
        pod: pod(
            "vllm-7d9f6-z5w2m",
            "uid-3",
            json!({
                "phase": "Pending",
                "containerStatuses": [{
                    "name": "vllm", "image": "vllm/vllm-openai", "imageID": "", "ready": false,
                    "restartCount": 0,
                    "state": {"waiting": {"reason": "ContainerCreating"}}
                }]
            }),
        ),
        events: Vec::new(),
        xids: Vec::new(),
    }
}

#[test]
fn a_startup_probe_shorter_than_the_cold_start_gets_the_timing_to_paste() {
    let c = check("deploy/vllm", "ml-serving", &[looping()]);
    let k = &c.containers[0];
    assert_eq!(k.probe, ProbeKind::Startup);
    assert_eq!(k.window_seconds, Some(330));
    assert_eq!(k.verdict, VerdictKind::WindowTooShort);
    assert_eq!(k.needs_at_least_seconds, Some(331));
    let r = k.recommended.expect("a recommendation");
    assert_eq!(
        (
            r.initial_delay_seconds,
            r.period_seconds,
            r.timeout_seconds,
            r.failure_threshold,
            r.window_seconds
        ),
        (30, 10, 5, 47, 500)
    );
    assert_eq!(c.restarts[0].cause, "StartupProbe");

    let out = text(&c, Style::default());
    for want in [
        "deploy/vllm in namespace ml-serving: 1 pod(s), 0 Ready",
        "  ml-serving/vllm-7d9f6-k2x8p Running, not Ready, on 192.168.1.1, waiting (vllm: CrashLoopBackOff)",
        "  bounded by   startupProbe",
        "  window       initialDelaySeconds 30 + failureThreshold 30 × max(periodSeconds 10, timeoutSeconds 5) = 330s",
        "  cold starts  ml-serving/vllm-7d9f6-k2x8p: killed by its probe 331s after it started, never Ready",
        "  verdict      WindowTooShort: startup window 330s is shorter than its cold start (at least 331s); set startupProbe.failureThreshold to 47 (window 500s)",
        "  Set in the pod template, for a 500s window: the cold start seen (at least 331s) plus 50%:\n\
         \x20   containers:\n\
         \x20     - name: vllm\n\
         \x20       startupProbe:\n\
         \x20         # keep its handler (httpGet, tcpSocket, exec or grpc) as it is; only the timing changes\n\
         \x20         initialDelaySeconds: 30\n\
         \x20         periodSeconds: 10\n\
         \x20         timeoutSeconds: 5\n\
         \x20         failureThreshold: 47  # was 30\n",
        "  ml-serving/vllm-7d9f6-k2x8p container vllm: 4 time(s), last killed by its startup probe before it started: a probe problem, not a GPU failure",
    ] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
}

#[test]
fn a_cold_start_inside_the_window_is_ok() {
    let c = check("deploy/vllm", "ml-serving", &[ready()]);
    let k = &c.containers[0];
    assert_eq!(k.verdict, VerdictKind::Ok);
    assert_eq!(k.recommended, None);
    assert_eq!(k.observed[0].kind, "ready");
    assert_eq!(k.observed[0].seconds, 200);
    assert!(c.not_serving.is_empty(), "{}", c.not_serving);
    let out = text(&c, Style::default());
    assert!(
        out.contains(
            "  verdict      Ok: startup window 330s covers the slowest observed cold start (200s)"
        ),
        "{out}"
    );
    assert!(
        !out.contains("startupProbe:\n"),
        "no snippet when Ok:\n{out}"
    );
}

#[test]
fn a_pending_pod_says_what_is_missing() {
    let c = check("pod/vllm-7d9f6-z5w2m", "ml-serving", &[pending()]);
    let k = &c.containers[0];
    assert_eq!(k.verdict, VerdictKind::Unknown);
    assert_eq!(
        k.missing.as_deref(),
        Some("no pod of the workload has become Ready or been killed by its probe yet")
    );
    let out = text(&c, Style::default());
    assert!(out.contains("  cold starts  none observed"), "{out}");
    assert!(
        out.contains("  missing      no pod of the workload has become Ready or been killed by its probe yet; run this again"),
        "{out}"
    );
}

#[test]
fn every_pod_counts_and_the_slowest_start_decides() {
    // The Ready pod took 200 s, the other was killed at 331 s: the window
    // must cover the kill, whatever the lucky pod did.
    let c = check(
        "deploy/vllm",
        "ml-serving",
        &[ready(), looping(), pending()],
    );
    assert_eq!(c.pods.len(), 3);
    assert_eq!(c.ready, 1);
    let k = &c.containers[0];
    assert_eq!(k.observed.len(), 2);
    assert_eq!(k.verdict, VerdictKind::WindowTooShort);
    assert_eq!(k.needs_at_least_seconds, Some(331));
}

#[test]
fn events_about_an_earlier_pod_of_the_same_name_are_not_this_ones() {
    let mut p = looping();
    for e in &mut p.events {
        e.involved_object.uid = Some("an-earlier-pod".into());
    }
    let c = check("pod/vllm-7d9f6-k2x8p", "ml-serving", &[p]);
    // Without its Killing Event the restart is only an exit code.
    assert_eq!(c.restarts[0].cause, "ExitedWithError");
    assert!(c.containers[0].observed.is_empty());
}

#[test]
fn json_names_each_field() {
    let c = check("deploy/vllm", "ml-serving", &[looping()]);
    let v = serde_json::to_value(&c).expect("json");
    let k = &v["containers"][0];
    assert_eq!(v["target"], "deploy/vllm");
    assert_eq!(k["probe"], "startup");
    assert_eq!(k["windowSeconds"], 330);
    assert_eq!(k["verdict"], "WindowTooShort");
    assert_eq!(k["needsAtLeastSeconds"], 331);
    assert_eq!(k["recommended"]["failureThreshold"], 47);
    assert_eq!(k["observed"][0]["kind"], "killedAfter");
    assert_eq!(v["restarts"][0]["count"], 4);
    assert!(k.get("missing").is_none());
}

#[test]
fn targets_read_as_kubectl_writes_them() {
    let p = |s: &str| Target::parse(s);
    assert_eq!(p("vllm-0"), Ok(Target::Pod("vllm-0".into())));
    assert_eq!(p("pod/vllm-0"), Ok(Target::Pod("vllm-0".into())));
    for d in ["deploy/vllm", "deployment/vllm", "deployments/vllm"] {
        assert_eq!(p(d), Ok(Target::Deployment("vllm".into())), "{d}");
    }
    for s in ["sts/db", "statefulset/db", "StatefulSets/db"] {
        assert_eq!(p(s), Ok(Target::StatefulSet("db".into())), "{s}");
    }
    assert_eq!(
        p("rs/vllm-7d9f6"),
        Ok(Target::ReplicaSet("vllm-7d9f6".into()))
    );
    assert!(p("job/x").is_err_and(|e| e.contains("deploy/NAME")));
    assert!(p("deploy/").is_err());
    assert!(p("a/b/c").is_err());
    assert_eq!(Target::Deployment("vllm".into()).to_string(), "deploy/vllm");
}

#[test]
fn selectors_become_label_queries_and_empty_ones_are_refused() {
    let s: LabelSelector = serde_json::from_value(json!({
        "matchLabels": {"app": "vllm"},
        "matchExpressions": [{"key": "tier", "operator": "In", "values": ["gpu"]}]
    }))
    .expect("selector");
    assert_eq!(
        label_query("deploy/vllm", Some(&s)),
        Ok("app=vllm,tier in (gpu)".into())
    );
    assert!(label_query("deploy/x", Some(&LabelSelector::default())).is_err());
    assert!(label_query("deploy/x", None).is_err());
}

#[test]
fn a_pod_brings_its_siblings_and_a_lone_pod_only_itself() {
    let a = looping().pod;
    let b = ready().pod;
    let mut stranger = pending().pod;
    stranger.metadata.owner_references = None;
    let all = vec![a.clone(), b.clone(), stranger.clone()];
    let names = |pods: Vec<Pod>| -> Vec<String> {
        pods.into_iter()
            .map(|p| p.metadata.name.unwrap_or_default())
            .collect()
    };
    assert_eq!(
        names(siblings(&a, all.clone())),
        ["vllm-7d9f6-k2x8p", "vllm-7d9f6-q8r4t"]
    );
    assert_eq!(names(siblings(&stranger, all)), ["vllm-7d9f6-z5w2m"]);
}

#[test]
fn a_pod_gets_the_xids_of_the_gpus_it_holds() {
    let report = GpuReport::parse(include_str!(
        "../../../gpuhealth-api/tests/fixtures/incident-gpu-report.json"
    ))
    .expect("report");
    let xids = report.xids_of_pod("ml-serving", "vllm-0");
    assert_eq!(xids.iter().map(|x| x.code).collect::<Vec<_>>(), [119, 154]);
    assert!(
        report
            .xids_of_pod("ml-serving", "qwen-7d9f8c6b5-x2x9k")
            .is_empty()
    );
}
