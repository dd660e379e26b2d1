//! A TCP proxy between one client and the API server that can stop
//! forwarding: a network partition for the fencing scenario. While cut,
//! connections stay open (new ones are accepted too) and every byte either
//! way is dropped, as on a link that silently loses packets; nothing sent
//! during the cut is ever delivered later.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

use crate::{HarnessError, Result, wait::Background};

pub struct Proxy {
    pub addr: SocketAddr,
    forwarding: Arc<AtomicBool>,
    _accept: Background,
}

impl Proxy {
    /// Listens on a free loopback port and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| HarnessError::ClusterStart(format!("proxy: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| HarnessError::ClusterStart(format!("proxy: {e}")))?;
        let forwarding = Arc::new(AtomicBool::new(true));
        let accept = {
            let forwarding = forwarding.clone();
            Background::spawn(async move {
                // The connections' tasks end with the accept loop.
                let mut links = Vec::new();
                while let Ok((client, _)) = listener.accept().await {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        continue;
                    };
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    links.push(Background::spawn(pump(
                        client_read,
                        server_write,
                        forwarding.clone(),
                    )));
                    links.push(Background::spawn(pump(
                        server_read,
                        client_write,
                        forwarding.clone(),
                    )));
                }
            })
        };
        Ok(Proxy {
            addr,
            forwarding,
            _accept: accept,
        })
    }

    /// Stops forwarding: from now on, every byte either way is dropped.
    pub fn cut(&self) {
        self.forwarding.store(false, Ordering::SeqCst);
    }

    /// Forwards again.
    pub fn restore(&self) {
        self.forwarding.store(true, Ordering::SeqCst);
    }
}

/// Copies `from` to `to` while forwarding; drops what arrives otherwise.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    forwarding: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if forwarding.load(Ordering::SeqCst) && to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
