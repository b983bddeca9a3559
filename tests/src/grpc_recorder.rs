//! A recording gRPC proxy in front of the Pub/Sub emulator, for what the emulator does not show:
//! every call's headers (`authorization`, `grpc-timeout`, `x-goog-request-params`, the client's
//! names) and each `Publish` request's contents (its topic, messages, ordering keys and encoded
//! size), decoded with `prost` copies of Pub/Sub's `.proto` messages. It forwards every call to
//! the emulator unchanged, so what the client publishes really arrives. Optionally it serves TLS
//! with a certificate of a private CA made for the test ([`TestCa`], with `openssl`).

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

#[derive(Clone)]
struct Recorder {
    calls: Arc<Mutex<Vec<Call>>>,
    upstream: Channel,
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
            let publish = path
                .ends_with("/Publish")
                .then(|| PublishRequest::decode(message).ok())
                .flatten();
            let call = Call {
                at: Instant::now(),
                authorization: header(&parts, "authorization"),
                grpc_timeout: header(&parts, "grpc-timeout"),
                request_params: header(&parts, "x-goog-request-params"),
                api_client: header(&parts, "x-goog-api-client"),
                user_agent: header(&parts, "user-agent"),
                size: message.len(),
                publish,
                path,
            };
            if let Ok(mut calls) = this.calls.lock() {
                calls.push(call);
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
    calls: Arc<Mutex<Vec<Call>>>,
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
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let addr = listener.local_addr().expect("bound address");
        let upstream = Endpoint::from_shared(format!("http://{upstream}"))
            .expect("the emulator's address")
            .connect_lazy();
        let calls: Arc<Mutex<Vec<Call>>> = Arc::default();
        let recorder = Recorder {
            calls: calls.clone(),
            upstream,
        };
        let mut server = Server::builder();
        if let Some(ca) = ca {
            // Already installed by an earlier recorder of this process: fine.
            let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
            let cert = std::fs::read(&ca.server_cert).expect("read the server certificate");
            let key = std::fs::read(&ca.server_key).expect("read the server key");
            server = server
                .tls_config(ServerTlsConfig::new().identity(Identity::from_pem(cert, key)))
                .expect("TLS for the recorder");
        }
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let router = server.add_service(recorder);
        let serve = tokio::spawn(async move {
            let _ = router.serve_with_incoming(incoming).await;
        })
        .abort_handle();
        Self {
            addr,
            tls: ca.is_some(),
            calls,
            serve,
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
