//! The operator's API client: kube's own stack (TLS, base URI, auth,
//! headers, timeouts), over connections that reset when they close.
//!
//! Why: a replica that loses its Lease in a partition stops and exits, but
//! the kernel keeps retransmitting what it had sent and not yet delivered
//! after a normal close, so a write decided while leading could reach the
//! API server after the standby has taken over and acted. With `SO_LINGER`
//! zero a close resets the connection and the kernel drops what it holds,
//! and a connection is never shut down gracefully either (hyper does, for a
//! request given up on, such as a Lease renewal that timed out): once this
//! process is gone, nothing it wrote arrives later.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use http::Uri;
use hyper_util::{
    client::legacy::{
        Client as HyperClient,
        connect::{Connected, Connection, HttpConnector},
    },
    rt::{TokioExecutor, TokioIo},
};
use kube::{
    Config,
    client::{Body, ClientBuilder, ConfigExt, DynBody},
};
use tokio::net::TcpStream;
use tower::{BoxError, Service, ServiceBuilder, ServiceExt, util::BoxService};

/// The stack kube's own builder makes, boxed.
pub type Stack = BoxService<http::Request<Body>, http::Response<Box<DynBody>>, BoxError>;

/// A client builder like `ClientBuilder::try_from(config)`, whose
/// connections reset on close. A kubeconfig naming a proxy gets kube's
/// own stack (the proxy holds the connection to the API server, not us).
pub fn builder(config: Config) -> kube::Result<ClientBuilder<Stack>> {
    if config.proxy_url.is_some() {
        tracing::warn!(
            "the kubeconfig names a proxy: its connections to the API server are not reset when this replica stops"
        );
        return ClientBuilder::try_from(config);
    }
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    let https = config.rustls_https_connector_with_connector(ResetOnClose(http))?;
    let mut connector = hyper_timeout::TimeoutConnector::new(https);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    let client: HyperClient<_, Body> = HyperClient::builder(TokioExecutor::new()).build(connector);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(client)
        .map_response(|res: http::Response<_>| {
            res.map(|body| {
                Box::new(http_body_util::BodyExt::map_err(body, BoxError::from)) as Box<DynBody>
            })
        });
    Ok(ClientBuilder::new(
        BoxService::new(service),
        config.default_namespace,
    ))
}

/// Connects as `HttpConnector` does, then sets `SO_LINGER` to zero.
#[derive(Clone)]
struct ResetOnClose(HttpConnector);

impl Service<Uri> for ResetOnClose {
    type Response = NoShutdown;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.0.poll_ready(cx).map_err(BoxError::from)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let connecting = self.0.call(uri);
        Box::pin(async move {
            let io = connecting.await?;
            socket2::SockRef::from(io.inner()).set_linger(Some(Duration::ZERO))?;
            Ok(NoShutdown(io))
        })
    }
}

/// A connection whose graceful shutdown does nothing: it ends only when
/// dropped, with a reset. What was written and not delivered by then is
/// lost, never delivered late.
struct NoShutdown(TokioIo<TcpStream>);

impl Connection for NoShutdown {
    fn connected(&self) -> Connected {
        self.0.connected()
    }
}

impl hyper::rt::Read for NoShutdown {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl hyper::rt::Write for NoShutdown {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn is_write_vectored(&self) -> bool {
        self.0.is_write_vectored()
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write_vectored(cx, bufs)
    }
}

#[cfg(test)]
mod tests {
    use std::io::ErrorKind;

    use tokio::{io::AsyncReadExt, net::TcpListener};

    use super::*;

    #[tokio::test]
    async fn a_connection_ends_with_a_reset_never_a_graceful_close() {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let uri: Uri = format!("http://{}", listener.local_addr().expect("addr"))
            .parse()
            .expect("uri");
        let mut connector = ResetOnClose(HttpConnector::new());
        let mut conn = connector
            .ready()
            .await
            .expect("ready")
            .call(uri)
            .await
            .expect("connect");
        let (mut server, _) = listener.accept().await.expect("accept");
        // A graceful shutdown sends nothing: the server sees no end of stream.
        std::future::poll_fn(|cx| hyper::rt::Write::poll_shutdown(Pin::new(&mut conn), cx))
            .await
            .expect("shutdown");
        let mut buf = [0u8; 8];
        let quiet = tokio::time::timeout(Duration::from_millis(300), server.read(&mut buf)).await;
        assert!(quiet.is_err(), "the server read {quiet:?}");
        // Dropped, it resets: the server's read fails, it never reads an end.
        drop(conn);
        let read = server.read(&mut buf).await;
        assert_eq!(read.map_err(|e| e.kind()), Err(ErrorKind::ConnectionReset));
    }
}
