//! A TCP proxy between a client and a real service, for failures the service cannot produce on
//! demand: going down (refusing and cutting connections), stalling (connections stay open and
//! accepted, but nothing moves and nothing errors: packets silently dropped), and added latency.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

#[derive(Debug, Default)]
struct State {
    down: AtomicBool,
    stalled: AtomicBool,
    /// HTTP/2 requests (streams) open now across connections, and the most seen at once.
    h2_open: AtomicU64,
    h2_max: AtomicU64,
    /// HTTP/2 requests opened since the start.
    h2_total: AtomicU64,
    delay_ms: AtomicU64,
    connections: Mutex<Vec<AbortHandle>>,
}

/// A running proxy; stops when dropped.
#[derive(Debug)]
pub struct TcpProxy {
    addr: SocketAddr,
    state: Arc<State>,
    accept: AbortHandle,
}

impl TcpProxy {
    /// Starts a proxy on a free loopback port forwarding to `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let addr = listener.local_addr().expect("bound address");
        let state = Arc::new(State::default());
        let upstream = upstream.to_owned();
        let st = state.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if st.down.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let st2 = st.clone();
                let upstream = upstream.clone();
                let handle = tokio::spawn(async move {
                    wait_while_stalled(&st2).await;
                    let Ok(server) = TcpStream::connect(&upstream).await else {
                        return;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let streams = Arc::new(Mutex::new(H2Streams::default()));
                    let up = pipe(
                        cr,
                        sw,
                        st2.clone(),
                        Some((Direction::ToServer, streams.clone())),
                    );
                    let down = pipe(
                        sr,
                        cw,
                        st2.clone(),
                        Some((Direction::ToClient, streams.clone())),
                    );
                    let _ = tokio::join!(up, down);
                    // Streams still open when the connection ends are over too.
                    let left = streams.lock().map(|s| s.open.len() as u64).unwrap_or(0);
                    st2.h2_open.fetch_sub(left, Ordering::SeqCst);
                });
                if let Ok(mut list) = st.connections.lock() {
                    list.retain(|h| !h.is_finished());
                    list.push(handle.abort_handle());
                }
            }
        })
        .abort_handle();
        Self {
            addr,
            state,
            accept,
        }
    }

    /// `host:port` clients should use.
    pub fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// Down: cut every open connection and refuse new ones. Up: forward again.
    pub fn set_down(&self, down: bool) {
        self.state.down.store(down, Ordering::SeqCst);
        if down && let Ok(mut list) = self.state.connections.lock() {
            for h in list.drain(..) {
                h.abort();
            }
        }
    }

    /// Stalled: nothing is forwarded in either direction and new connections are accepted but
    /// not served, with no error (a black hole). Unstalled: what was held moves on, as after a
    /// healed network partition.
    pub fn set_stalled(&self, stalled: bool) {
        self.state.stalled.store(stalled, Ordering::SeqCst);
    }

    /// The most HTTP/2 requests (gRPC calls) that were in flight at once through the proxy, across
    /// its connections: a request opens with the client's HEADERS on a new stream and ends with
    /// the server's END_STREAM (or a reset). Plain HTTP/1 connections are not counted.
    pub fn max_requests_in_flight(&self) -> u64 {
        self.state.h2_max.load(Ordering::SeqCst)
    }

    /// The HTTP/2 requests (gRPC calls) sent through the proxy since it started.
    pub fn requests_sent(&self) -> u64 {
        self.state.h2_total.load(Ordering::SeqCst)
    }

    /// Starts counting [`Self::max_requests_in_flight`] afresh from the requests open now.
    pub fn reset_max_requests_in_flight(&self) {
        let open = self.state.h2_open.load(Ordering::SeqCst);
        self.state.h2_max.store(open, Ordering::SeqCst);
    }

    /// Delays every chunk forwarded (both directions) by `delay`, without serialising them: a
    /// chunk read while earlier ones wait is itself forwarded `delay` after it arrived.
    pub fn set_delay(&self, delay: Duration) {
        self.state.delay_ms.store(
            u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
            Ordering::SeqCst,
        );
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.set_down(true);
    }
}

/// Forwards `from` to `to`. With a delay set, every chunk is held until `delay` after it was
/// read, but reading goes on meanwhile: the link adds latency without limiting how many
/// requests are on the wire at once (HTTP/2 multiplexes many streams on one connection).
async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    state: Arc<State>,
    h2: Option<(Direction, Arc<Mutex<H2Streams>>)>,
) {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(tokio::time::Instant, Vec<u8>)>();
    let reader = {
        let state = state.clone();
        async move {
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                wait_while_stalled(&state).await;
                let n = match from.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                let delay = Duration::from_millis(state.delay_ms.load(Ordering::SeqCst));
                let due = tokio::time::Instant::now() + delay;
                if tx.send((due, buf[..n].to_vec())).is_err() {
                    break;
                }
            }
        }
    };
    let writer = async move {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if let Some((dir, streams)) = &h2
                && let Ok(mut s) = streams.lock()
            {
                s.feed(*dir, &chunk, &state);
            }
            wait_while_stalled(&state).await;
            if to.write_all(&chunk).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    };
    // The writer ends when the reader's sender is gone and every chunk was written (or the
    // peer is gone).
    tokio::join!(reader, writer);
}

async fn wait_while_stalled(state: &State) {
    while state.stalled.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    ToServer,
    ToClient,
}

/// Just enough HTTP/2 framing to count requests: the 9-byte frame headers of both directions.
#[derive(Debug, Default)]
struct H2Streams {
    /// Whether the client sent the HTTP/2 preface (else this is not an HTTP/2 connection).
    h2: Option<bool>,
    to_server: Vec<u8>,
    to_client: Vec<u8>,
    open: std::collections::HashSet<u32>,
}

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

impl H2Streams {
    fn feed(&mut self, dir: Direction, bytes: &[u8], state: &State) {
        let buf = match dir {
            Direction::ToServer => &mut self.to_server,
            Direction::ToClient => &mut self.to_client,
        };
        buf.extend_from_slice(bytes);
        if self.h2.is_none() && dir == Direction::ToServer && self.to_server.len() >= PREFACE.len()
        {
            let is_h2 = self.to_server.starts_with(PREFACE);
            self.h2 = Some(is_h2);
            if is_h2 {
                self.to_server.drain(..PREFACE.len());
            }
        }
        if self.h2 != Some(true) {
            if self.h2 == Some(false) {
                self.to_server.clear();
                self.to_client.clear();
            }
            return;
        }
        let buf = match dir {
            Direction::ToServer => &mut self.to_server,
            Direction::ToClient => &mut self.to_client,
        };
        let mut frames = Vec::new();
        while buf.len() >= 9 {
            let len =
                (usize::from(buf[0]) << 16) | (usize::from(buf[1]) << 8) | usize::from(buf[2]);
            if buf.len() < 9 + len {
                break;
            }
            let (kind, flags) = (buf[3], buf[4]);
            let id = u32::from_be_bytes([buf[5] & 0x7f, buf[6], buf[7], buf[8]]);
            frames.push((kind, flags, id));
            buf.drain(..9 + len);
        }
        for (kind, flags, id) in frames {
            let opened = dir == Direction::ToServer && kind == 0x1 && id % 2 == 1;
            let ended =
                (dir == Direction::ToClient && (kind == 0x0 || kind == 0x1) && flags & 0x1 != 0)
                    || kind == 0x3;
            if opened && self.open.insert(id) {
                state.h2_total.fetch_add(1, Ordering::SeqCst);
                let now = state.h2_open.fetch_add(1, Ordering::SeqCst) + 1;
                state.h2_max.fetch_max(now, Ordering::SeqCst);
            } else if ended && self.open.remove(&id) {
                state.h2_open.fetch_sub(1, Ordering::SeqCst);
            }
        }
    }
}
