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
//!
//! A lagging proxy ([`Proxy::lagging`]) answers requests at once but
//! delivers what the server streams late: bytes from the server that come
//! while the client has sent nothing for a second (a watch's events, not
//! the answer to a request just sent) reach the client `lag` late, in order.
//! A slow proxy ([`Proxy::slow`]) delivers everything the server sends
//! `lag` late, the answers to requests included: an API server slow to
//! answer.

use std::{
    net::SocketAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::{mpsc, watch},
    time::Instant,
};

use crate::{HarnessError, Result, wait::Background};

/// Which of the server's bytes reach the client late.
#[derive(Clone, Copy, Debug)]
enum Lag {
    /// What it streams while the client has sent nothing for a second.
    Streams(Duration),
    /// Everything.
    All(Duration),
}

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
        Proxy::open(upstream, None).await
    }

    /// Like [`Proxy::start`], delivering what the server streams `lag` late.
    pub async fn lagging(upstream: SocketAddr, lag: Duration) -> Result<Proxy> {
        Proxy::open(upstream, Some(Lag::Streams(lag))).await
    }

    /// Like [`Proxy::start`], delivering every answer `lag` late.
    pub async fn slow(upstream: SocketAddr, lag: Duration) -> Result<Proxy> {
        Proxy::open(upstream, Some(Lag::All(lag))).await
    }

    async fn open(upstream: SocketAddr, lag: Option<Lag>) -> Result<Proxy> {
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
                    let sent = Arc::new(Stamp::default());
                    links.push(Background::spawn(pump(
                        client_read,
                        server_write,
                        link.subscribe(),
                        held.clone(),
                        Some(sent.clone()),
                    )));
                    links.push(match lag {
                        None => Background::spawn(pump(
                            server_read,
                            client_write,
                            link.subscribe(),
                            Arc::default(),
                            None,
                        )),
                        Some(lag) => {
                            Background::spawn(lagging_pump(server_read, client_write, lag, sent))
                        }
                    });
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

/// When the client last sent anything on a connection.
struct Stamp(Mutex<Instant>);

impl Default for Stamp {
    fn default() -> Self {
        Stamp(Mutex::new(Instant::now()))
    }
}

impl Stamp {
    fn touch(&self) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    }

    fn age(&self) -> Duration {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).elapsed()
    }
}

/// How long a client has been quiet when what the server sends is taken
/// for a stream rather than an answer.
const QUIET: Duration = Duration::from_secs(1);

/// Copies what the server sends to the client, late as `lag` says.
async fn lagging_pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    lag: Lag,
    sent: Arc<Stamp>,
) {
    let (queue, mut due) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let reader = async move {
        let mut buf = vec![0u8; 64 * 1024];
        let mut last = Instant::now();
        while let Ok(n @ 1..) = from.read(&mut buf).await {
            let late = match lag {
                Lag::Streams(lag) if sent.age() > QUIET => lag,
                Lag::Streams(_) => Duration::ZERO,
                Lag::All(lag) => lag,
            };
            // In order: nothing overtakes bytes held back before it.
            last = last.max(Instant::now() + late);
            if queue.send((last, buf[..n].to_vec())).is_err() {
                break;
            }
        }
    };
    let writer = async move {
        while let Some((at, bytes)) = due.recv().await {
            tokio::time::sleep_until(at).await;
            if to.write_all(&bytes).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}

/// Copies `from` to `to` as the link says, counting what it holds in
/// `held`, and stamping `sent` with each read.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut link: watch::Receiver<Link>,
    held: Arc<Held>,
    sent: Option<Arc<Stamp>>,
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
            Woke::Read(Ok(n)) => {
                if let Some(sent) = &sent {
                    sent.touch();
                }
                match now_link(&link) {
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
                }
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that answers a request at once, then, after the client has
    /// been quiet past `QUIET`, streams.
    async fn answer_then_stream() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            let (mut conn, _) = listener.accept().await.expect("accept");
            let mut buf = [0u8; 16];
            let _ = conn.read(&mut buf).await;
            conn.write_all(b"answer").await.expect("answer");
            tokio::time::sleep(QUIET + Duration::from_millis(500)).await;
            conn.write_all(b"stream").await.expect("stream");
            // Held open until the client is done.
            let _ = conn.read(&mut buf).await;
        });
        addr
    }

    #[tokio::test]
    async fn a_lagging_proxy_answers_at_once_and_streams_late() {
        let lag = Duration::from_secs(2);
        let proxy = Proxy::lagging(answer_then_stream().await, lag)
            .await
            .expect("proxy");
        let mut client = TcpStream::connect(proxy.addr).await.expect("connect");
        client.write_all(b"request").await.expect("request");
        let mut buf = [0u8; 6];
        // The answer comes well before the lag would have let it.
        tokio::time::timeout(lag / 2, client.read_exact(&mut buf))
            .await
            .expect("the answer is not held back")
            .expect("read");
        assert_eq!(&buf, b"answer");
        let answered = Instant::now();
        client.read_exact(&mut buf).await.expect("read");
        assert_eq!(&buf, b"stream");
        // Sent QUIET + 0.5 s after the answer, delivered `lag` later.
        assert!(
            answered.elapsed() >= lag + QUIET,
            "{:?}",
            answered.elapsed()
        );
    }
}
