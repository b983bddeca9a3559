//! A recording gRPC proxy in front of the Pub/Sub emulator, for what the emulator does not show:
//! every call's headers (`authorization`, `x-goog-user-project`, `grpc-timeout`,
//! `x-goog-request-params`, the client's names, the `:authority`) and each `Publish` request's
//! contents (its topic, messages, ordering keys and encoded size), decoded with `prost` copies of
//! Pub/Sub's `.proto` messages. It forwards every call to the emulator unchanged, so what the
//! client publishes really arrives. Optionally it serves TLS with a certificate of a private CA
//! made for the test ([`TestCa`], with `openssl`; ALPN h2, as Google's front end).
//!
//! It also answers as Google's front end does where the emulator never does ([`Refusal`]): a
//! topic refused with a code for a while and then accepted (PERMISSION_DENIED while a grant
//! propagates, NOT_FOUND before the topic exists, ...), a fraction of calls refused
//! (RESOURCE_EXHAUSTED: quota), `GetTopic` refused to a publisher-only identity, and connections
//! recycled by a graceful GOAWAY after a maximum age ([`Options::max_connection_age`]).

use std::collections::{BTreeSet, HashMap};
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use http_body_util::BodyExt;
use prost::Message as _;
use tokio::net::TcpListener;
use tokio::task::AbortHandle;
use tonic::body::Body;
use tonic::codegen::{BoxFuture, Service};
use tonic::transport::{Channel, Endpoint, Identity, Server, ServerTlsConfig};

/// `google.pubsub.v1.PubsubMessage`, the fields a publisher sets.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PubsubMessage {
    #[prost(bytes = "vec", tag = "1")]
    pub data: Vec<u8>,
    #[prost(map = "string, string", tag = "2")]
    pub attributes: HashMap<String, String>,
    #[prost(string, tag = "5")]
    pub ordering_key: String,
}

/// `google.pubsub.v1.PublishRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct PublishRequest {
    #[prost(string, tag = "1")]
    pub topic: String,
    #[prost(message, repeated, tag = "2")]
    pub messages: Vec<PubsubMessage>,
}

/// One call the proxy forwarded.
#[derive(Debug, Clone)]
pub struct Call {
    /// `/google.pubsub.v1.Publisher/Publish`, …
    pub path: String,
    /// When it arrived.
    pub at: Instant,
    /// The headers of interest ("" when absent).
    pub authorization: String,
    pub grpc_timeout: String,
    pub request_params: String,
    pub api_client: String,
    pub user_agent: String,
    pub user_project: String,
    /// The request's `:authority`.
    pub authority: String,
    /// The code the proxy answered itself instead of forwarding (None: forwarded).
    pub refused: Option<tonic::Code>,
    /// The request message's encoded size (without gRPC's 5-byte frame header).
    pub size: usize,
    /// For `Publish`: the request, decoded.
    pub publish: Option<PublishRequest>,
}

impl Call {
    /// The distinct ordering keys of a `Publish` ("" for none).
    pub fn ordering_keys(&self) -> BTreeSet<String> {
        self.publish
            .iter()
            .flat_map(|p| p.messages.iter().map(|m| m.ordering_key.clone()))
            .collect()
    }

    /// How many messages a `Publish` held.
    pub fn messages(&self) -> usize {
        self.publish.as_ref().map_or(0, |p| p.messages.len())
    }
}

/// A refusal the proxy answers itself instead of forwarding.
#[derive(Debug, Clone)]
pub struct Refusal {
    /// Calls about this topic (full name; `None`: every topic).
    pub topic: Option<String>,
    /// The code, and the message the status carries.
    pub code: tonic::Code,
    pub message: String,
    /// Until this instant (`None`: until healed).
    pub until: Option<Instant>,
    /// The share of calls refused (1.0: every one), by a seeded counter so runs repeat.
    pub fraction: f64,
    /// Only `Publish` calls (`GetTopic` goes through), or both.
    pub publish_only: bool,
    /// A throughput quota instead of a share: a `Publish` is refused when the messages accepted
    /// in the last 10 seconds and its own would pass 10 x this many (what a publisher throughput
    /// quota per minute does, on a shorter window: sending slower gets more accepted).
    pub messages_per_second: Option<usize>,
}

impl Refusal {
    /// Every call about `topic` refused with `code` for `lasting` from now, then accepted.
    pub fn topic_for(topic: &str, code: tonic::Code, lasting: std::time::Duration) -> Self {
        Self {
            topic: Some(topic.to_owned()),
            message: format!("refused by the stand-in ({code:?}) for {lasting:?}"),
            code,
            until: Some(Instant::now() + lasting),
            fraction: 1.0,
            publish_only: false,
            messages_per_second: None,
        }
    }
}

/// How the proxy serves.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Recycle each connection after this age with a graceful GOAWAY (Google's front end does,
    /// and so does any gRPC server with a maximum connection age).
    pub max_connection_age: Option<std::time::Duration>,
    /// Answer `GetTopic` PERMISSION_DENIED, as Pub/Sub answers an identity that may publish to
    /// the topic but not read it (roles/pubsub.publisher alone).
    pub publisher_only: bool,
}

#[derive(Clone)]
struct Recorder {
    calls: Arc<Mutex<Vec<Call>>>,
    refusals: Arc<Mutex<Vec<Refusal>>>,
    /// Calls seen by each fractional refusal (the seeded counter).
    counter: Arc<std::sync::atomic::AtomicU64>,
    /// Messages accepted in the last second, for a throughput quota.
    accepted: Arc<Mutex<std::collections::VecDeque<(Instant, usize)>>>,
    publisher_only: bool,
    upstream: Channel,
}

impl Recorder {
    /// The refusal of a call to `path` about `topic` carrying `messages`, if any applies now.
    fn refusal(&self, path: &str, topic: &str, messages: usize) -> Option<(tonic::Code, String)> {
        let publish = path.ends_with("/Publish");
        if self.publisher_only && path.ends_with("/GetTopic") {
            return Some((
                tonic::Code::PermissionDenied,
                format!(
                    "User not authorized to perform this action. (pubsub.topics.get on {topic})"
                ),
            ));
        }
        let now = Instant::now();
        let rules = self.refusals.lock().ok()?;
        let rule = rules.iter().find(|r| {
            r.topic.as_deref().is_none_or(|t| t == topic)
                && r.until.is_none_or(|u| now < u)
                && (publish || !r.publish_only)
        })?;
        if let Some(quota) = rule.messages_per_second.filter(|_| publish) {
            let mut window = self.accepted.lock().ok()?;
            while window
                .front()
                .is_some_and(|(at, _)| now.duration_since(*at) > std::time::Duration::from_secs(10))
            {
                window.pop_front();
            }
            let sent: usize = window.iter().map(|(_, n)| n).sum();
            if sent + messages <= quota * 10 {
                window.push_back((now, messages));
                return None;
            }
            return Some((rule.code, rule.message.clone()));
        }
        if rule.fraction < 1.0 {
            // A golden-ratio sequence: evenly spread, the same on every run.
            let n = self
                .counter
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let x = (n as f64 * 0.618_033_988_749_895).fract();
            if x >= rule.fraction {
                return None;
            }
        }
        Some((rule.code, rule.message.clone()))
    }
}

impl tonic::server::NamedService for Recorder {
    const NAME: &'static str = "google.pubsub.v1.Publisher";
}

fn header(parts: &http::request::Parts, name: &str) -> String {
    parts
        .headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned()
}

impl Service<http::Request<Body>> for Recorder {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(
        &mut self,
        _cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let this = self.clone();
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let bytes = match body.collect().await {
                Ok(collected) => collected.to_bytes(),
                Err(e) => {
                    let status = tonic::Status::internal(format!("recorder: reading: {e}"));
                    return Ok(status.into_http());
                }
            };
            let message = bytes.get(5..).unwrap_or_default();
            let path = parts.uri.path().to_owned();
            // GetTopicRequest's topic is field 1 too: the same decoding reads it.
            let decoded = PublishRequest::decode(message).ok();
            let topic = decoded
                .as_ref()
                .map(|p| p.topic.clone())
                .unwrap_or_default();
            let publish = decoded.filter(|_| path.ends_with("/Publish"));
            let count = publish.as_ref().map_or(0, |p| p.messages.len());
            let refused = this.refusal(&path, &topic, count);
            let call = Call {
                at: Instant::now(),
                authorization: header(&parts, "authorization"),
                grpc_timeout: header(&parts, "grpc-timeout"),
                request_params: header(&parts, "x-goog-request-params"),
                api_client: header(&parts, "x-goog-api-client"),
                user_agent: header(&parts, "user-agent"),
                user_project: header(&parts, "x-goog-user-project"),
                authority: parts
                    .uri
                    .authority()
                    .map(|a| a.to_string())
                    .unwrap_or_else(|| header(&parts, "host")),
                refused: refused.as_ref().map(|(code, _)| *code),
                size: message.len(),
                publish,
                path,
            };
            if let Ok(mut calls) = this.calls.lock() {
                calls.push(call);
            }
            if let Some((code, message)) = refused {
                return Ok(tonic::Status::new(code, message).into_http());
            }
            let forward =
                http::Request::from_parts(parts, Body::new(http_body_util::Full::new(bytes)));
            let mut upstream = this.upstream.clone();
            let answer = match std::future::poll_fn(|cx| upstream.poll_ready(cx)).await {
                Ok(()) => upstream.call(forward).await,
                Err(e) => Err(e),
            };
            Ok(match answer {
                Ok(response) => response.map(Body::new),
                Err(e) => {
                    tonic::Status::unavailable(format!("recorder: upstream: {e}")).into_http()
                }
            })
        })
    }
}

/// A running recorder; stops when dropped.
#[derive(Debug)]
pub struct GrpcRecorder {
    addr: std::net::SocketAddr,
    tls: bool,
    /// Connections accepted so far.
    accepted: Arc<std::sync::atomic::AtomicUsize>,
    calls: Arc<Mutex<Vec<Call>>>,
    refusals: Arc<Mutex<Vec<Refusal>>>,
    serve: AbortHandle,
}

impl std::fmt::Debug for Recorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Recorder")
    }
}

impl GrpcRecorder {
    /// Starts on a free loopback port, forwarding to the emulator at `upstream` (`host:port`);
    /// TLS with `ca`'s server certificate when given.
    pub async fn start(upstream: &str, ca: Option<&TestCa>) -> Self {
        Self::start_with(upstream, ca, Options::default()).await
    }

    /// [`Self::start`], serving as `options` say.
    pub async fn start_with(upstream: &str, ca: Option<&TestCa>, options: Options) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let addr = listener.local_addr().expect("bound address");
        let upstream = Endpoint::from_shared(format!("http://{upstream}"))
            .expect("the emulator's address")
            .connect_lazy();
        let calls: Arc<Mutex<Vec<Call>>> = Arc::default();
        let refusals: Arc<Mutex<Vec<Refusal>>> = Arc::default();
        let recorder = Recorder {
            calls: calls.clone(),
            refusals: refusals.clone(),
            counter: Arc::default(),
            accepted: Arc::default(),
            publisher_only: options.publisher_only,
            upstream,
        };
        let mut server = Server::builder();
        if let Some(age) = options.max_connection_age {
            server = server.max_connection_age(age);
        }
        if let Some(ca) = ca {
            // Already installed by an earlier recorder of this process: fine.
            let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
            let cert = std::fs::read(&ca.server_cert).expect("read the server certificate");
            let key = std::fs::read(&ca.server_key).expect("read the server key");
            server = server
                .tls_config(ServerTlsConfig::new().identity(Identity::from_pem(cert, key)))
                .expect("TLS for the recorder");
        }
        // Every connection accepted is counted (a GOAWAY makes the client open a new one).
        let accepted: Arc<std::sync::atomic::AtomicUsize> = Arc::default();
        let incoming = futures::stream::unfold(
            (listener, accepted.clone()),
            |(listener, accepted)| async move {
                let next = listener.accept().await.map(|(stream, _)| {
                    let _ = stream.set_nodelay(true);
                    accepted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    stream
                });
                Some((next, (listener, accepted)))
            },
        );
        let router = server.add_service(recorder);
        let serve = tokio::spawn(async move {
            let _ = router.serve_with_incoming(incoming).await;
        })
        .abort_handle();
        Self {
            addr,
            tls: ca.is_some(),
            accepted,
            calls,
            refusals,
            serve,
        }
    }

    /// Refuses calls as `refusal` says, from now on (the first matching rule answers).
    pub fn refuse(&self, refusal: Refusal) {
        if let Ok(mut r) = self.refusals.lock() {
            r.push(refusal);
        }
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> usize {
        self.accepted.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Forgets every refusal.
    pub fn heal(&self) {
        if let Ok(mut r) = self.refusals.lock() {
            r.clear();
        }
    }

    /// `https://localhost:PORT` (TLS) or `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        if self.tls {
            format!("https://localhost:{}", self.addr.port())
        } else {
            format!("http://{}", self.addr)
        }
    }

    /// Every call so far, in arrival order.
    pub fn calls(&self) -> Vec<Call> {
        self.calls.lock().map(|c| c.clone()).unwrap_or_default()
    }

    /// The `Publish` calls so far.
    pub fn publishes(&self) -> Vec<Call> {
        self.calls()
            .into_iter()
            .filter(|c| c.publish.is_some())
            .collect()
    }
}

impl Drop for GrpcRecorder {
    fn drop(&mut self) {
        self.serve.abort();
    }
}

/// A private certificate authority and a server certificate it signed for `localhost` and
/// `127.0.0.1`, made with `openssl` in a scratch directory (removed on drop).
#[derive(Debug)]
pub struct TestCa {
    dir: PathBuf,
    /// The CA's certificate (what a client must be told to trust).
    pub ca_cert: PathBuf,
    /// The server's certificate and key.
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = std::process::Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl (apt-get install openssl)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

impl TestCa {
    /// Makes the CA and the server certificate.
    pub fn new() -> Self {
        let dir = std::env::temp_dir().join(crate::env::unique_name("test-ca"));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"];
        let mut ca = vec!["req", "-x509", "-nodes", "-days", "2"];
        ca.extend(ec);
        ca.extend([
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-subj",
            "/CN=pubsub-outbox test CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ]);
        openssl(&dir, &ca);
        let mut csr = vec!["req", "-nodes"];
        csr.extend(ec);
        csr.extend([
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=localhost",
        ]);
        openssl(&dir, &csr);
        std::fs::write(
            dir.join("server.ext"),
            "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n\
             basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\n",
        )
        .expect("write the extensions");
        openssl(
            &dir,
            &[
                "x509",
                "-req",
                "-in",
                "server.csr",
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-days",
                "2",
                "-out",
                "server.pem",
                "-extfile",
                "server.ext",
            ],
        );
        Self {
            ca_cert: dir.join("ca.pem"),
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
            dir,
        }
    }
}

impl Default for TestCa {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for TestCa {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
