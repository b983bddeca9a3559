//! The Pub/Sub transport: unary gRPC calls (`Publish`, and `GetTopic` for the probe) on tonic,
//! over a small pool of HTTP/2 connections. The only module that opens connections to Pub/Sub.
//!
//! Per request it adds what Google's own clients add: the `authorization` header from
//! google-cloud-auth's Application Default Credentials (cached and refreshed by them; anonymous
//! for the emulator), `grpc-timeout` (the time left of the publish), `x-goog-request-params:
//! topic=…` (routing) and `x-goog-api-client` naming this project, the user agent too.
//! Connections: TLS (rustls on aws-lc) with the system's roots, plus a private CA when one is
//! given (a Private Service Connect endpoint); plain HTTP/2 for the emulator. HTTP/2 keep-alive
//! pings every 5 minutes while calls are open (what Google's Go client sends; servers refuse
//! more frequent ones), TCP keep-alive, and each connection reconnects by itself after the
//! server went away. At most [`STREAMS_PER_CONNECTION`] calls are open per connection (the
//! official clients' bound); a call waits for a free one.
//!
//! It retries nothing: a failed request's messages go back to their rows, whose durable schedule
//! retries them (ARCHITECTURE.md, "The transport").

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use google_cloud_auth::credentials::{CacheableResource, Credentials, EntityTag};
use tokio::sync::Semaphore;
use tonic::Status;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint};

use crate::config::PubsubConfig;
use crate::error::DispatcherError;

/// The most calls open at once on one connection.
pub const STREAMS_PER_CONNECTION: usize = 100;

/// Pub/Sub's global endpoint.
pub const GLOBAL_ENDPOINT: &str = "https://pubsub.googleapis.com";

/// Why a call got no result.
#[derive(Debug)]
pub enum Failed {
    /// Pub/Sub, or a proxy before it, answered with this status.
    Answered(Status),
    /// No answer: the connection could not be made or broke, or the deadline passed. What
    /// happened, for people (the innermost cause, not the transport's debug dumps).
    NoAnswer(String),
    /// No credentials to send (the token endpoint failed).
    Credentials(String),
    /// Never sent: the request cannot be formed (a topic that cannot be a header value).
    NotSent(String),
}

/// The credentials of every request, and the headers last made from them.
struct Auth {
    credentials: Credentials,
    cached: Mutex<Option<(EntityTag, http::HeaderMap)>>,
}

impl Auth {
    /// The headers to send: the cached ones while the credentials say they are still current.
    async fn headers(&self) -> Result<http::HeaderMap, Failed> {
        let mut extensions = http::Extensions::new();
        let known = self.lock().as_ref().map(|(tag, _)| tag.clone());
        if let Some(tag) = known {
            extensions.insert(tag);
        }
        match self.credentials.headers(extensions).await {
            Ok(CacheableResource::New { entity_tag, data }) => {
                *self.lock() = Some((entity_tag, data.clone()));
                Ok(data)
            }
            Ok(CacheableResource::NotModified) => match self.lock().as_ref() {
                Some((_, headers)) => Ok(headers.clone()),
                None => Err(Failed::Credentials(
                    "the credentials answered \"not modified\" before any token".to_owned(),
                )),
            },
            Err(e) => Err(Failed::Credentials(e.to_string())),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<(EntityTag, http::HeaderMap)>> {
        match self.cached.lock() {
            Ok(c) => c,
            Err(poisoned) => poisoned.into_inner(),
        }
    }
}

/// The pool of connections and what every request carries.
pub struct Transport {
    channels: Box<[Channel]>,
    next: AtomicUsize,
    streams: Semaphore,
    auth: Option<Auth>,
    api_client: MetadataValue<tonic::metadata::Ascii>,
    /// Where it connects, for messages.
    endpoint: String,
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transport")
            .field("endpoint", &self.endpoint)
            .field("connections", &self.channels.len())
            .field("authenticated", &self.auth.is_some())
            .finish_non_exhaustive()
    }
}

/// The URI to connect to: the endpoint given (`https://` assumed without a scheme), the
/// emulator's (plain HTTP), or the global endpoint.
fn endpoint_uri(args: &PubsubConfig) -> String {
    match (&args.endpoint, &args.emulator_host) {
        (Some(e), _) if e.contains("://") => e.trim_end_matches('/').to_owned(),
        (Some(e), _) => format!("https://{}", e.trim_end_matches('/')),
        (None, Some(host)) if host.contains("://") => host.clone(),
        (None, Some(host)) => format!("http://{host}"),
        (None, None) => GLOBAL_ENDPOINT.to_owned(),
    }
}

/// The `:authority` requests to `uri` carry when it is not the endpoint's own: `given`, else the
/// one Google's clients derive (google-cloud-rust's gax-internal `host.rs`). For a
/// `*.googleapis.com` host that is neither the service's own name (`pubsub.googleapis.com`), a
/// regional one (`pubsub.REGION.rep.googleapis.com`) nor a locational one
/// (`REGION-pubsub.googleapis.com`), that is `pubsub.googleapis.com`: `private.googleapis.com`,
/// `restricted.googleapis.com` (VPC Service Controls) and Private Service Connect names
/// (`pubsub-ENDPOINT.p.googleapis.com`) route by it. Any other name (an emulator, a proxy of
/// your own) keeps its own. TLS still verifies (and names, in SNI) the endpoint's host.
pub fn authority(uri: &str, given: Option<&str>) -> Option<String> {
    if let Some(given) = given {
        return Some(given.to_owned());
    }
    let host = uri
        .split_once("://")
        .map_or(uri, |(_, rest)| rest)
        .split(['/', ':'])
        .next()
        .unwrap_or_default();
    let prefix = host.strip_suffix(".googleapis.com")?;
    let own = match prefix.split('.').collect::<Vec<_>>()[..] {
        ["pubsub"] => true,
        ["pubsub", _, "rep"] => true,
        [location] => location
            .strip_suffix("-pubsub")
            .is_some_and(|region| !region.is_empty()),
        _ => false,
    };
    (!own).then(|| "pubsub.googleapis.com".to_owned())
}

impl Transport {
    /// Opens the pool (lazily: connections are made at the first call and remade after a
    /// failure). Errors are configuration errors: a malformed endpoint, an unreadable CA file,
    /// no Application Default Credentials.
    pub fn open(args: &PubsubConfig) -> Result<Self, DispatcherError> {
        let uri = endpoint_uri(args);
        let fail = |reason: String| DispatcherError::PubsubClient {
            endpoint: uri.clone(),
            reason,
        };
        let version = env!("CARGO_PKG_VERSION");
        let mut endpoint = Endpoint::from_shared(uri.clone())
            .map_err(|e| fail(format!("not a valid endpoint URI ({e})")))?
            .user_agent(format!("pubsub-outbox/{version}"))
            .map_err(|e| fail(e.to_string()))?
            .connect_timeout(Duration::from_secs(10))
            .tcp_nodelay(true)
            .tcp_keepalive(Some(Duration::from_secs(60)))
            .http2_keep_alive_interval(Duration::from_secs(300))
            .keep_alive_timeout(Duration::from_secs(20));
        if let Some(authority) = authority(&uri, args.authority.as_deref()) {
            let origin = http::Uri::try_from(format!("https://{authority}")).map_err(|e| {
                fail(format!(
                    "--pubsub-authority {authority:?} is not a host name ({e})"
                ))
            })?;
            endpoint = endpoint.origin(origin);
        }
        if uri.starts_with("https://") {
            let mut tls = ClientTlsConfig::new().with_native_roots();
            if let Some(path) = &args.ca_file {
                let pem = std::fs::read(path).map_err(|e| {
                    fail(format!(
                        "cannot read --pubsub-ca-file {}: {e}",
                        path.display()
                    ))
                })?;
                if !String::from_utf8_lossy(&pem).contains("-----BEGIN CERTIFICATE-----") {
                    return Err(fail(format!(
                        "--pubsub-ca-file {} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
                        path.display()
                    )));
                }
                tls = tls.ca_certificate(Certificate::from_pem(pem));
            }
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| fail(format!("cannot set up TLS: {e}")))?;
        } else if args.ca_file.is_some() {
            return Err(fail(
                "--pubsub-ca-file is set but the endpoint is plain HTTP (the emulator): give an \
                 https:// endpoint, or drop the CA file"
                    .to_owned(),
            ));
        }
        let auth = if args.emulator_host.is_some() {
            None
        } else {
            let credentials = google_cloud_auth::credentials::Builder::default()
                .build()
                .map_err(|e| fail(format!("no Application Default Credentials: {e}")))?;
            Some(Auth {
                credentials,
                cached: Mutex::new(None),
            })
        };
        let connections = args.connections.max(1);
        let channels = (0..connections).map(|_| endpoint.connect_lazy()).collect();
        let api_client = MetadataValue::try_from(format!(
            "gl-rust/unknown gccl/pubsub-outbox-{version} grpc/0.14"
        ))
        .map_err(|e| fail(e.to_string()))?;
        Ok(Self {
            channels,
            next: AtomicUsize::new(0),
            streams: Semaphore::new(connections * STREAMS_PER_CONNECTION),
            auth,
            api_client,
            endpoint: uri,
        })
    }

    /// Where it connects.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The routing header of requests about `topic` (`x-goog-request-params: topic=…`), made
    /// once per topic of a batch; a topic that cannot be a header value is never sent.
    /// The error says why (what [`Failed::NotSent`] carries).
    pub(crate) fn route(topic: &str) -> Result<Route, String> {
        let params = format!(
            "topic={}",
            form_urlencoded::byte_serialize(topic.as_bytes()).collect::<String>()
        );
        MetadataValue::try_from(params)
            .map(Route)
            .map_err(|e| format!("topic {topic:?} cannot be sent as a header: {e}"))
    }

    /// Calls `path` with the encoded request `body` (made once a stream is free), routed by
    /// `route`, carrying `timeout` as its `grpc-timeout`. The caller bounds the wait (a publish
    /// by `--publish-timeout` for the whole batch, the probe by its deadline): one timer per
    /// batch, not one per request.
    pub(crate) async fn call<R: prost::Message + Default + Send + Sync + 'static>(
        &self,
        path: &'static str,
        route: &Route,
        body: impl FnOnce() -> Bytes,
        timeout: Duration,
    ) -> Result<R, Failed> {
        let _stream = self
            .streams
            .acquire()
            .await
            .map_err(|_| Failed::NoAnswer("the transport is closed".to_owned()))?;
        let mut metadata = match &self.auth {
            Some(auth) => MetadataMap::from_headers(auth.headers().await?),
            None => MetadataMap::new(),
        };
        metadata.insert("x-goog-request-params", route.0.clone());
        metadata.insert("x-goog-api-client", self.api_client.clone());
        let mut request = tonic::Request::from_parts(metadata, Default::default(), body());
        request.set_timeout(timeout);
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.channels.len();
        let mut grpc = tonic::client::Grpc::new(self.channels[i].clone());
        grpc.ready().await.map_err(|e| {
            Failed::NoAnswer(innermost(
                &format!("cannot connect to {}", self.endpoint),
                &e,
            ))
        })?;
        let path = http::uri::PathAndQuery::from_static(path);
        match grpc
            .unary(request, path, crate::pubsub::wire::Codec::<R>::default())
            .await
        {
            Ok(answer) => Ok(answer.into_inner()),
            // A status made from a local error (no connection, a broken stream) carries it as
            // its source; one the server sent does not.
            Err(status) if std::error::Error::source(&status).is_some() => Err(Failed::NoAnswer(
                innermost(&format!("{} failed", self.endpoint), &status),
            )),
            Err(status) => Err(Failed::Answered(status)),
        }
    }
}

/// A topic's routing header, made by [`Transport::route`].
#[derive(Debug, Clone)]
pub(crate) struct Route(MetadataValue<tonic::metadata::Ascii>);

/// `what`, with the innermost cause of `e` (`connection refused (os error 111)`), rather than
/// the transport's own text, which embeds statuses and metadata as debug dumps.
pub fn innermost(what: &str, e: &(dyn std::error::Error + 'static)) -> String {
    let mut last = e;
    while let Some(cause) = last.source() {
        last = cause;
    }
    let text = last.to_string();
    if text.is_empty() {
        what.to_owned()
    } else {
        format!("{what}: {text}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_endpoint_is_the_one_given_the_emulators_or_the_global_one() {
        let mut c = PubsubConfig::default();
        assert_eq!(endpoint_uri(&c), GLOBAL_ENDPOINT);
        c.emulator_host = Some("127.0.0.1:8085".into());
        assert_eq!(endpoint_uri(&c), "http://127.0.0.1:8085");
        c.endpoint = Some("us-east1-pubsub.googleapis.com".into());
        assert_eq!(endpoint_uri(&c), "https://us-east1-pubsub.googleapis.com");
        c.endpoint = Some("https://psc.example:443/".into());
        assert_eq!(endpoint_uri(&c), "https://psc.example:443");
    }

    #[test]
    fn private_and_restricted_vips_and_psc_names_carry_pubsubs_authority_as_googles_clients_do() {
        let p = Some("pubsub.googleapis.com".to_owned());
        for (endpoint, want) in [
            ("https://pubsub.googleapis.com", None),
            ("https://us-east1-pubsub.googleapis.com", None),
            ("https://pubsub.me-central2.rep.googleapis.com", None),
            ("https://private.googleapis.com", p.clone()),
            ("https://restricted.googleapis.com:443", p.clone()),
            ("https://pubsub-myendpoint.p.googleapis.com", p.clone()),
            ("https://-pubsub.googleapis.com", p.clone()),
            ("https://localhost:8443", None),
            ("https://pubsub.internal.example.com", None),
            ("http://127.0.0.1:8085", None),
        ] {
            assert_eq!(authority(endpoint, None), want, "{endpoint}");
        }
        assert_eq!(
            authority(
                "https://pubsub.internal.example.com",
                Some("pubsub.googleapis.com")
            ),
            p,
            "--pubsub-authority wins"
        );
    }

    #[test]
    fn a_failure_reads_as_its_innermost_cause_not_a_debug_dump() {
        #[derive(Debug, thiserror::Error)]
        #[error("status: Unavailable, metadata: MetadataMap {{ headers: {{}} }}")]
        struct Dump(#[source] std::io::Error);
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let text = refused.to_string();
        let said = innermost("cannot connect to http://x", &Dump(refused));
        assert_eq!(said, format!("cannot connect to http://x: {text}"));
    }

    #[tokio::test]
    async fn a_ca_file_that_is_missing_or_not_pem_or_on_plain_http_is_a_configuration_error() {
        let mut c = PubsubConfig {
            endpoint: Some("https://127.0.0.1:1".into()),
            emulator_host: Some("127.0.0.1:1".into()),
            ca_file: Some("/nonexistent/ca.pem".into()),
            ..PubsubConfig::default()
        };
        let e = Transport::open(&c).expect_err("missing file");
        assert!(
            e.to_string().contains("cannot read --pubsub-ca-file"),
            "{e}"
        );
        let dir = std::env::temp_dir().join(format!("outbox-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let not_pem = dir.join("not.pem");
        std::fs::write(&not_pem, b"hello").expect("write");
        c.ca_file = Some(not_pem);
        let e = Transport::open(&c).expect_err("not PEM");
        assert!(e.to_string().contains("holds no PEM certificate"), "{e}");
        c.endpoint = None;
        let e = Transport::open(&c).expect_err("plain HTTP");
        assert!(e.to_string().contains("plain HTTP"), "{e}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
