//! A TCP proxy between one client and the API server that can stop
//! forwarding: a network partition for the fencing scenarios. While cut,
//! connections stay open (new ones are accepted too) and every byte either
//! way is dropped, as on a link that silently loses packets. While held,
//! every byte either way is kept and delivered, in order, on release: the
//! late partition, where what the client sent before the partition healed
//! still arrives. The held bytes stand for what the client's kernel has
//! not yet delivered: a client that resets its connection (an abortive
//! close) loses them, as its kernel would; one that closes it normally
//! does not.

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::watch,
};

use crate::{HarnessError, Result, wait::Background};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Link {
    Forward,
    Cut,
    Hold,
}

/// What became of the client's bytes held in a late partition.
#[derive(Debug, Default)]
pub struct Held {
    /// Held while the link was held.
    pub bytes: AtomicU64,
    /// Delivered on release.
    pub delivered: AtomicU64,
    /// Lost when the client reset its connection.
    pub discarded: AtomicU64,
}

impl Held {
    /// Bytes held now: neither delivered nor lost yet.
    pub fn pending(&self) -> u64 {
        let read = |n: &AtomicU64| n.load(Ordering::SeqCst);
        read(&self.bytes).saturating_sub(read(&self.delivered) + read(&self.discarded))
    }

    pub fn delivered(&self) -> u64 {
        self.delivered.load(Ordering::SeqCst)
    }
}

pub struct Proxy {
    pub addr: SocketAddr,
    link: watch::Sender<Link>,
    /// Of the bytes from the client to the API server.
    pub held: Arc<Held>,
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
        let (link, _) = watch::channel(Link::Forward);
        let held = Arc::new(Held::default());
        let accept = {
            let link = link.clone();
            let held = held.clone();
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
                        link.subscribe(),
                        held.clone(),
                    )));
                    links.push(Background::spawn(pump(
                        server_read,
                        client_write,
                        link.subscribe(),
                        Arc::default(),
                    )));
                }
            })
        };
        Ok(Proxy {
            addr,
            link,
            held,
            _accept: accept,
        })
    }

    /// Stops forwarding: from now on, every byte either way is dropped.
    pub fn cut(&self) {
        self.link.send_replace(Link::Cut);
    }

    /// Stops forwarding: from now on, every byte either way is kept.
    pub fn hold(&self) {
        self.link.send_replace(Link::Hold);
    }

    /// Forwards again, what was held first.
    pub fn restore(&self) {
        self.link.send_replace(Link::Forward);
    }
}

/// The link as it is now (the guard is not held across an await).
fn now_link(link: &watch::Receiver<Link>) -> Link {
    *link.borrow()
}

/// What a pump waited for.
enum Woke {
    Read(std::io::Result<usize>),
    LinkChanged,
    ProxyGone,
}

/// Copies `from` to `to` as the link says, counting what it holds in `held`.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut link: watch::Receiver<Link>,
    held: Arc<Held>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut kept: Vec<u8> = Vec::new();
    let mut open = true;
    loop {
        let now = *link.borrow_and_update();
        if now == Link::Forward && !kept.is_empty() {
            if to.write_all(&kept).await.is_err() {
                break;
            }
            held.delivered
                .fetch_add(kept.len() as u64, Ordering::SeqCst);
            kept.clear();
        }
        if !open && kept.is_empty() {
            break;
        }
        let woke = if open {
            tokio::select! {
                read = from.read(&mut buf) => Woke::Read(read),
                changed = link.changed() => match changed {
                    Ok(()) => Woke::LinkChanged,
                    Err(_) => Woke::ProxyGone,
                },
            }
        } else {
            // Closed normally with bytes still held: they go on release.
            match link.changed().await {
                Ok(()) => Woke::LinkChanged,
                Err(_) => Woke::ProxyGone,
            }
        };
        match woke {
            Woke::LinkChanged => {}
            Woke::ProxyGone => break,
            Woke::Read(Ok(0)) => open = false,
            Woke::Read(Ok(n)) => match now_link(&link) {
                Link::Forward => {
                    if to.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
                Link::Cut => {}
                Link::Hold => {
                    kept.extend_from_slice(&buf[..n]);
                    held.bytes.fetch_add(n as u64, Ordering::SeqCst);
                }
            },
            // Reset: what the client's kernel had not delivered is gone.
            Woke::Read(Err(_)) => {
                held.discarded
                    .fetch_add(kept.len() as u64, Ordering::SeqCst);
                return;
            }
        }
    }
    let _ = to.shutdown().await;
}
