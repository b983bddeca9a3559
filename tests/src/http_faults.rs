//! An HTTP/1.1 fault injector in front of a real service (bqemulator): answers chosen requests
//! with scripted failures (an HTML 502 from a "front end", a bare JSON 503, …) and forwards the
//! rest, for answers the real service cannot produce on demand.
//!
//! Deliberately small: one request per connection (`Connection: close` both ways), requests with
//! a `Content-Length` body (what reqwest sends), responses read to the end of the upstream
//! connection.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

/// A scripted answer.
#[derive(Debug, Clone)]
pub struct Fault {
    /// Applies to the first request whose request line (`GET /path?query HTTP/1.1`) contains this.
    pub matching: String,
    /// HTTP status.
    pub status: u16,
    /// `Content-Type` of the body.
    pub content_type: String,
    /// The body.
    pub body: String,
}

impl Fault {
    /// The HTML page a Google front-end proxy answers when the backend is unreachable.
    pub fn html_502(matching: &str) -> Self {
        Self {
            matching: matching.to_owned(),
            status: 502,
            content_type: "text/html; charset=UTF-8".into(),
            body: "<!DOCTYPE html><html lang=en><title>Error 502 (Server Error)!!1</title>\
                   <p><b>502.</b> That's an error.</p></html>"
                .into(),
        }
    }

    /// A JSON 503 in the current error format: no legacy `errors` array.
    pub fn bare_503(matching: &str) -> Self {
        Self {
            matching: matching.to_owned(),
            status: 503,
            content_type: "application/json; charset=UTF-8".into(),
            body: r#"{"error": {"code": 503, "message": "The service is currently unavailable.", "status": "UNAVAILABLE"}}"#.into(),
        }
    }
}

#[derive(Debug, Default)]
struct State {
    faults: Mutex<VecDeque<Fault>>,
    served: Mutex<Vec<(u16, String)>>,
    /// The `Authorization` header of every request ("" when it had none).
    authorizations: Mutex<Vec<String>>,
}

/// A running fault injector; stops when dropped.
#[derive(Debug)]
pub struct HttpFaults {
    addr: SocketAddr,
    state: Arc<State>,
    accept: AbortHandle,
}

impl HttpFaults {
    /// Starts on a free loopback port (bound once, read back) in front of `upstream` (`host:port`).
    pub async fn start(upstream: &str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let addr = listener.local_addr().expect("bound address");
        let state = Arc::new(State::default());
        let (st, upstream) = (state.clone(), upstream.to_owned());
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (st, upstream) = (st.clone(), upstream.clone());
                tokio::spawn(async move {
                    let _ = serve(client, &upstream, &st).await;
                });
            }
        })
        .abort_handle();
        Self {
            addr,
            state,
            accept,
        }
    }

    /// `http://host:port` clients should use.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Queues `fault`: the next matching request gets it instead of the upstream's answer.
    pub fn push(&self, fault: Fault) {
        if let Ok(mut q) = self.state.faults.lock() {
            q.push_back(fault);
        }
    }

    /// The faults answered so far: (status, request line).
    pub fn served(&self) -> Vec<(u16, String)> {
        self.state
            .served
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default()
    }

    /// The `Authorization` header of every request so far, in order ("" when it had none).
    pub fn authorizations(&self) -> Vec<String> {
        self.state
            .authorizations
            .lock()
            .map(|a| a.clone())
            .unwrap_or_default()
    }

    /// Faults queued but not answered yet.
    pub fn pending(&self) -> usize {
        self.state.faults.lock().map(|q| q.len()).unwrap_or(0)
    }
}

impl Drop for HttpFaults {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

async fn serve(mut client: TcpStream, upstream: &str, state: &State) -> std::io::Result<()> {
    let (head, body) = read_request(&mut client).await?;
    let request_line = head.lines().next().unwrap_or_default().to_owned();
    if let Ok(mut a) = state.authorizations.lock() {
        a.push(header(&head, "authorization").unwrap_or_default());
    }
    let fault = state.faults.lock().ok().and_then(|mut q| {
        let i = q.iter().position(|f| request_line.contains(&f.matching))?;
        q.remove(i)
    });
    if let Some(f) = fault {
        if let Ok(mut served) = state.served.lock() {
            served.push((f.status, request_line));
        }
        let response = format!(
            "HTTP/1.1 {} Fault\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
            f.status,
            f.content_type,
            f.body.len(),
            f.body
        );
        client.write_all(response.as_bytes()).await?;
        return client.shutdown().await;
    }
    // Forward with `Connection: close`, so the upstream ends its answer by closing.
    let mut forwarded: String = head
        .split("\r\n")
        .filter(|l| !l.to_ascii_lowercase().starts_with("connection:"))
        .map(|l| format!("{l}\r\n"))
        .collect();
    forwarded.push_str("Connection: close\r\n\r\n");
    let mut server = TcpStream::connect(upstream).await?;
    server.write_all(forwarded.as_bytes()).await?;
    server.write_all(&body).await?;
    let mut response = Vec::new();
    server.read_to_end(&mut response).await?;
    client.write_all(&response).await?;
    client.shutdown().await
}

/// The value of header `name` (any case) in a request head.
pub(crate) fn header(head: &str, name: &str) -> Option<String> {
    head.lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case(name))
        .map(|(_, v)| v.trim().to_owned())
}

/// Reads one request: its head (without the blank line) and its `Content-Length` body.
pub(crate) async fn read_request(client: &mut TcpStream) -> std::io::Result<(String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        let n = client.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..end]).into_owned();
    let length: usize = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse().ok())
        .unwrap_or(0);
    let mut body = buf[end + 4..].to_vec();
    while body.len() < length {
        let n = client.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Ok((head, body))
}
