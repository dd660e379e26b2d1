//! A fake API server for the operator's unit tests: a `kube::Client`
//! whose requests are recorded and answered from rules the test sets, so
//! that the reconcile's stages and each action run as they do against a
//! real one (the same client, the same requests, the API server's error
//! statuses), in milliseconds.

use std::{convert::Infallible, sync::Arc, time::Duration};

use gpuhealth_api::{GpuHealthPolicy, GpuNodeHealth};
use gpuhealth_engine::guardrails::Guardrails;
use http::{Request, Response};
use http_body_util::BodyExt;
use k8s_openapi::api::core::v1::Node;
use kube::{
    Client,
    client::Body,
    runtime::{
        reflector::{self, store::Writer},
        watcher::Event,
    },
};
use parking_lot::Mutex;
use serde_json::{Value, json};

use crate::{context::Context, leader::Leadership, validation};

/// One request the fake API server was sent.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    /// The path and query, as sent.
    pub uri: String,
    pub body: Value,
}

impl Seen {
    /// `"PATCH /api/v1/nodes/gpu-1"`, without the query.
    pub fn line(&self) -> String {
        let path = self.uri.split('?').next().unwrap_or_default();
        format!("{} {path}", self.method)
    }
}

type Rule = Box<dyn Fn(&Seen) -> Option<(u16, Value)> + Send + Sync>;

/// The fake API server: every request recorded, each answered by the
/// first rule that matches it, else as a real one would answer a write it
/// took (`answer_ok`).
#[derive(Clone, Default)]
pub struct FakeApi {
    seen: Arc<Mutex<Vec<Seen>>>,
    rules: Arc<Mutex<Vec<Rule>>>,
}

impl FakeApi {
    pub fn client(&self) -> Client {
        let api = self.clone();
        let service = tower::service_fn(move |request: Request<Body>| {
            let api = api.clone();
            async move { Ok::<_, Infallible>(api.answer(request).await) }
        });
        Client::new(service, "default")
    }

    /// Answers requests `method` to a path containing `path` with `code`
    /// and an API status (or, for 2xx, `answer_ok`'s body).
    pub fn on(&self, method: &'static str, path: &'static str, code: u16) {
        self.on_with(method, path, move |seen| {
            if (200..300).contains(&code) {
                (code, answer_ok(seen))
            } else {
                (code, status(code))
            }
        });
    }

    /// Answers requests `method` to a path containing `path` with what
    /// `answer` makes of each.
    pub fn on_with(
        &self,
        method: &'static str,
        path: &'static str,
        answer: impl Fn(&Seen) -> (u16, Value) + Send + Sync + 'static,
    ) {
        let rule: Rule = Box::new(move |seen| {
            let matches = seen.method == method
                && seen.uri.split('?').next().is_some_and(|p| p.contains(path));
            matches.then(|| answer(seen))
        });
        // Newest first: a test's later rule overrides an earlier one.
        self.rules.lock().insert(0, rule);
    }

    /// Every request so far, in order.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().clone()
    }

    /// Every request so far, as `method path` lines (Events left out:
    /// they are best effort, and each test asks for what it acts on).
    pub fn lines(&self) -> Vec<String> {
        self.seen()
            .iter()
            .map(Seen::line)
            .filter(|l| !l.contains("/events"))
            .collect()
    }

    async fn answer(&self, request: Request<Body>) -> Response<Body> {
        let (parts, body) = request.into_parts();
        let bytes = body
            .collect()
            .await
            .map(|b| b.to_bytes())
            .unwrap_or_default();
        let seen = Seen {
            method: parts.method.to_string(),
            uri: parts.uri.to_string(),
            body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
        };
        self.seen.lock().push(seen.clone());
        let (code, body) = self
            .rules
            .lock()
            .iter()
            .find_map(|rule| rule(&seen))
            .unwrap_or_else(|| (200, answer_ok(&seen)));
        Response::builder()
            .status(code)
            .header("content-type", "application/json")
            .body(Body::from(serde_json::to_vec(&body).unwrap_or_default()))
            .unwrap_or_else(|_| Response::new(Body::empty()))
    }
}

/// What an API server answers a write it took: a delete or an eviction,
/// a success status; a patch, create or apply, the object as sent, with
/// the name the path gives it; a list, an empty one.
pub fn answer_ok(seen: &Seen) -> Value {
    let path = seen.uri.split('?').next().unwrap_or_default();
    if seen.method == "DELETE" || path.ends_with("/eviction") {
        return json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"});
    }
    if seen.method == "GET" {
        return json!({"metadata": {"resourceVersion": "1"}, "items": []});
    }
    let name = path
        .trim_end_matches("/status")
        .rsplit('/')
        .next()
        .unwrap_or_default();
    let mut object = match &seen.body {
        Value::Object(_) => seen.body.clone(),
        _ => json!({}),
    };
    object["metadata"]["name"] = json!(name);
    if object.get("spec").is_none() {
        object["spec"] = json!({});
    }
    object
}

/// An API server's refusal with `code`.
pub fn status(code: u16) -> Value {
    let reason = match code {
        404 => "NotFound",
        409 => "Conflict",
        422 => "Invalid",
        429 => "TooManyRequests",
        _ => "InternalError",
    };
    json!({
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": format!("the fake API server answers {code}"),
        "reason": reason,
        "code": code,
    })
}

/// The operator's shared state over a [`FakeApi`], with its caches' writers.
pub struct World {
    pub api: FakeApi,
    pub ctx: Context,
    pub nodes: Writer<Node>,
    pub policies: Writer<GpuHealthPolicy>,
    pub node_health: Writer<GpuNodeHealth>,
}

impl World {
    /// The same, in a cluster that serves DRA and `DeviceTaintRule`s (as
    /// v1, Kubernetes 1.37's).
    pub fn with_dra(led_for: Duration) -> World {
        let mut w = World::new(led_for);
        let (slices, _) = reflector::store();
        let (claims, _) = reflector::store();
        let version = gpuhealth_api::device_taint_rule::RuleVersion::V1;
        let rules = reflector::store::Writer::new(version).as_reader();
        w.ctx.dra = Some(crate::devices::Dra {
            slices,
            claims,
            rules: Some(crate::fences::Rules {
                store: rules,
                version,
            }),
        });
        w
    }

    /// A replica that took the lease `led_for` ago.
    pub fn new(led_for: Duration) -> World {
        let api = FakeApi::default();
        let client = api.client();
        let (nodes_store, nodes) = reflector::store();
        let (policies_store, policies) = reflector::store();
        let (node_health_store, node_health) = reflector::store();
        let (budgets, _) = reflector::store();
        let ctx = Context {
            client: client.clone(),
            in_flight: Arc::default(),
            nodes: nodes_store,
            policies: policies_store,
            node_health: node_health_store,
            gpu_tables: Default::default(),
            budgets,
            dra: None,
            pod_health: Arc::default(),
            events: crate::events::Events::new(client, "gpuhealth-operator", "test"),
            memory: Default::default(),
            at_takeover: Default::default(),
            metrics: Arc::default(),
            protection: Arc::new(crate::protection::Protection::new(false)),
            guardrails: Guardrails::none(),
            failures: Default::default(),
            honour_announced: Mutex::default(),
            locks: Arc::default(),
            leadership: Leadership::held_since(led_for),
            crash_after: Default::default(),
            validation: validation::Target {
                namespace: "gpuhealth-validation".into(),
                service_account: "gpuhealth-validation".into(),
            },
            seal: crate::seal::Seal::from_key(&[7; 32]),
        };
        World {
            api,
            ctx,
            nodes,
            policies,
            node_health,
        }
    }
}

impl World {
    /// Puts a health record in the cache, slimmed as its watch slims it.
    pub fn cache_health(&mut self, mut health: GpuNodeHealth) {
        self.ctx.gpu_tables.slimmer()(&mut health);
        cache(&mut self.node_health, health);
    }
}

/// Puts `object` in a cache, as its watch would.
pub fn cache<K>(writer: &mut Writer<K>, object: K)
where
    K: kube::Resource + Clone,
    K::DynamicType: Clone + Eq + std::hash::Hash + Default,
{
    writer.apply_watcher_event(&Event::Apply(object));
}
