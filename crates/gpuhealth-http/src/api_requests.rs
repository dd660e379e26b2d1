//! The Kubernetes API requests a binary makes, counted by verb, resource and
//! status code: a tower layer for kube's client stack. What it costs the API
//! server (a quiet cluster should cost nothing; a remediation a few dozen
//! requests) is then on `/metrics`, as `*_api_requests_total`.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use axum::http::{Method, Request, Response, Uri};
use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family},
};
use tower::{Layer, Service};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// The API server's verbs: `get`, `list`, `watch`, `create`, `update`,
    /// `patch`, `delete`, `deletecollection`.
    pub verb: String,
    /// `nodes`, `pods/eviction`, `gpunodehealths/status`, ...
    pub resource: String,
    /// The HTTP status, or `error` when no response came.
    pub code: String,
}

/// The counter family the layer feeds; register it in the binary's registry.
pub type ApiRequests = Family<RequestLabels, Counter>;

/// Counts every request that goes through the client built with it.
#[derive(Clone, Debug, Default)]
pub struct CountRequests(pub ApiRequests);

impl<S> Layer<S> for CountRequests {
    type Service = Counted<S>;

    fn layer(&self, inner: S) -> Counted<S> {
        Counted {
            inner,
            counts: self.0.clone(),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Counted<S> {
    inner: S,
    counts: ApiRequests,
}

impl<S, B, R> Service<Request<B>> for Counted<S>
where
    S: Service<Request<B>, Response = Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let (verb, resource) = classify(request.method(), request.uri());
        let counts = self.counts.clone();
        let response = self.inner.call(request);
        Box::pin(async move {
            let response = response.await;
            let code = match &response {
                Ok(r) => r.status().as_u16().to_string(),
                Err(_) => "error".to_owned(),
            };
            counts
                .get_or_create(&RequestLabels {
                    verb: verb.to_owned(),
                    resource,
                    code,
                })
                .inc();
            response
        })
    }
}

/// The API server's verb and the resource (with its subresource) of a
/// request, from its method and path: `/api/v1/namespaces/ml/pods/p/eviction`
/// is (`create`, `pods/eviction`).
pub fn classify(method: &Method, uri: &Uri) -> (&'static str, String) {
    let segments: Vec<&str> = uri.path().split('/').filter(|s| !s.is_empty()).collect();
    let rest = match segments.first() {
        Some(&"api") => segments.get(2..),
        Some(&"apis") => segments.get(3..),
        _ => None,
    }
    .unwrap_or_default();
    // `/api`, `/apis`, `/apis/GROUP`, `/apis/GROUP/VERSION`: what is served.
    let discovery = matches!(segments.first(), Some(&"api") | Some(&"apis")) && rest.is_empty();
    if discovery {
        return ("get", "discovery".to_owned());
    }
    // `namespaces/NS/RESOURCE...`; `namespaces` or `namespaces/NS` alone is
    // the namespace resource itself.
    let rest = match rest {
        ["namespaces", _, resource, tail @ ..] => [&[*resource][..], tail].concat(),
        _ => rest.to_vec(),
    };
    let resource = match rest.as_slice() {
        [] => "unknown".to_owned(),
        [resource] | [resource, _] => (*resource).to_owned(),
        [resource, _, sub, ..] => format!("{resource}/{sub}"),
    };
    let named = rest.len() >= 2;
    let watch = uri
        .query()
        .is_some_and(|q| q.split('&').any(|kv| kv == "watch=true" || kv == "watch=1"));
    let verb = match *method {
        Method::GET if watch => "watch",
        Method::GET if named => "get",
        Method::GET => "list",
        Method::POST => "create",
        Method::PUT => "update",
        Method::PATCH => "patch",
        Method::DELETE if named => "delete",
        Method::DELETE => "deletecollection",
        _ => "other",
    };
    (verb, resource)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(method: Method, uri: &str) -> (&'static str, String) {
        classify(&method, &uri.parse().expect("uri"))
    }

    #[test]
    fn requests_are_named_as_the_api_server_names_them() {
        let cases = [
            (Method::GET, "/api/v1/nodes", "list", "nodes"),
            (
                Method::GET,
                "/api/v1/nodes?watch=true&resourceVersion=1",
                "watch",
                "nodes",
            ),
            (Method::GET, "/api/v1/nodes/gpu-7", "get", "nodes"),
            (Method::PATCH, "/api/v1/nodes/gpu-7", "patch", "nodes"),
            (
                Method::PATCH,
                "/api/v1/nodes/gpu-7/status",
                "patch",
                "nodes/status",
            ),
            (
                Method::POST,
                "/api/v1/namespaces/ml/pods/vllm-0/eviction",
                "create",
                "pods/eviction",
            ),
            (
                Method::GET,
                "/api/v1/namespaces/ml/pods?fieldSelector=spec.nodeName%3Dn",
                "list",
                "pods",
            ),
            (
                Method::DELETE,
                "/api/v1/namespaces/ml/pods/vllm-0",
                "delete",
                "pods",
            ),
            (
                Method::DELETE,
                "/api/v1/namespaces/ml/pods",
                "deletecollection",
                "pods",
            ),
            (Method::GET, "/api/v1/namespaces/ml", "get", "namespaces"),
            (Method::GET, "/api/v1/namespaces", "list", "namespaces"),
            (
                Method::PUT,
                "/apis/coordination.k8s.io/v1/namespaces/gpuhealth-system/leases/op",
                "update",
                "leases",
            ),
            (
                Method::PATCH,
                "/apis/gpuhealth.io/v1alpha1/gpunodehealths/gpu-7/status",
                "patch",
                "gpunodehealths/status",
            ),
            (
                Method::POST,
                "/apis/events.k8s.io/v1/namespaces/default/events",
                "create",
                "events",
            ),
            (Method::GET, "/apis", "get", "discovery"),
            (Method::GET, "/api/v1", "get", "discovery"),
            (Method::GET, "/version", "list", "unknown"),
        ];
        for (method, uri, verb, resource) in cases {
            assert_eq!(of(method, uri), (verb, resource.to_owned()), "{uri}");
        }
    }
}
