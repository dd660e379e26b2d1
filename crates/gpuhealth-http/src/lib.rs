//! The HTTP endpoints both gpuhealth binaries serve: `/metrics` (the
//! Prometheus text format), `/livez` (the process is not stuck) and `/readyz`
//! (it is doing its job: what either means is each binary's to say); and the
//! client layer that counts each binary's Kubernetes API requests.

pub mod api_requests;

use std::sync::Arc;

use axum::{Router, extract::State, http::StatusCode, response::IntoResponse, routing::get};
use prometheus_client::{encoding::text::encode, registry::Registry};

/// What a binary exposes.
pub trait Exposition: Send + Sync + 'static {
    fn registry(&self) -> &Registry;
    /// Ready, or why not.
    fn ready(&self) -> Result<(), String>;
    /// Alive (restarting would not help), or why not: by default, answering.
    fn live(&self) -> Result<(), String> {
        Ok(())
    }
}

/// A registry in the text exposition format.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut out, registry);
    out
}

/// Serves the endpoints on `listener` until the process ends.
pub async fn serve(
    listener: tokio::net::TcpListener,
    exposition: Arc<dyn Exposition>,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/livez", get(livez))
        .route("/readyz", get(readyz))
        .with_state(exposition);
    tracing::info!(addr = %listener.local_addr()?, "serving /metrics, /livez and /readyz");
    axum::serve(listener, app).await
}

async fn metrics(State(e): State<Arc<dyn Exposition>>) -> impl IntoResponse {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        render(e.registry()),
    )
}

async fn readyz(State(e): State<Arc<dyn Exposition>>) -> impl IntoResponse {
    answer(e.ready())
}

async fn livez(State(e): State<Arc<dyn Exposition>>) -> impl IntoResponse {
    answer(e.live())
}

fn answer(state: Result<(), String>) -> (StatusCode, String) {
    match state {
        Ok(()) => (StatusCode::OK, "ok".to_owned()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
    }
}
