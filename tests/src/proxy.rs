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
                    let up = pipe(cr, sw, st2.clone());
                    let down = pipe(sr, cw, st2);
                    let _ = tokio::join!(up, down);
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

    /// Delays every chunk forwarded (both directions) by `delay`.
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

async fn pipe(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    state: Arc<State>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        wait_while_stalled(&state).await;
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let delay = state.delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        wait_while_stalled(&state).await;
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

async fn wait_while_stalled(state: &State) {
    while state.stalled.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
