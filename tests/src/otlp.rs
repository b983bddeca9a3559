//! A stand-in OTLP trace receiver: a gRPC `TraceService/Export` server on a loopback port, what
//! a collector or Cloud Trace's `telemetry.googleapis.com` is to the binaries. It keeps the spans
//! it receives (or only counts them, for benchmarks) so a test can follow one message's trace.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::common::v1::{AnyValue, KeyValue};
use tokio::net::TcpListener;
use tokio::task::AbortHandle;

/// One received span, its ids in lowercase hex.
#[derive(Debug, Clone, PartialEq)]
pub struct ReceivedSpan {
    /// The resource's `service.name`.
    pub service: String,
    pub name: String,
    pub trace_id: String,
    pub span_id: String,
    /// Empty for a root span.
    pub parent_span_id: String,
    /// OTLP's `SpanKind` (1 internal, 2 server, 3 client, 4 producer, 5 consumer).
    pub kind: i32,
    /// Attribute values as text.
    pub attributes: BTreeMap<String, String>,
    /// (trace id, span id) of each link.
    pub links: Vec<(String, String)>,
    /// Event names.
    pub events: Vec<String>,
    /// OTLP's status code (0 unset, 1 ok, 2 error).
    pub status: i32,
}

impl ReceivedSpan {
    /// An attribute's value, if set.
    pub fn attr(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

#[derive(Clone)]
struct Sink {
    keep: bool,
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    count: Arc<AtomicU64>,
}

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut received = Vec::new();
        for resource in request.into_inner().resource_spans {
            let service = resource
                .resource
                .as_ref()
                .and_then(|r| {
                    r.attributes
                        .iter()
                        .find(|kv| kv.key == "service.name")
                        .map(|kv| text(kv.value.as_ref()))
                })
                .unwrap_or_default();
            for scope in resource.scope_spans {
                for s in scope.spans {
                    self.count.fetch_add(1, Ordering::Relaxed);
                    if !self.keep {
                        continue;
                    }
                    received.push(ReceivedSpan {
                        service: service.clone(),
                        name: s.name,
                        trace_id: hex(&s.trace_id),
                        span_id: hex(&s.span_id),
                        parent_span_id: hex(&s.parent_span_id),
                        kind: s.kind,
                        attributes: attributes(&s.attributes),
                        links: s
                            .links
                            .iter()
                            .map(|l| (hex(&l.trace_id), hex(&l.span_id)))
                            .collect(),
                        events: s.events.into_iter().map(|e| e.name).collect(),
                        status: s.status.map_or(0, |st| st.code),
                    });
                }
            }
        }
        if let Ok(mut spans) = self.spans.lock() {
            spans.extend(received);
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse {
            partial_success: None,
        }))
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn text(value: Option<&AnyValue>) -> String {
    match value.and_then(|v| v.value.as_ref()) {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        Some(other) => format!("{other:?}"),
        None => String::new(),
    }
}

fn attributes(kvs: &[KeyValue]) -> BTreeMap<String, String> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), text(kv.value.as_ref())))
        .collect()
}

/// A running receiver; stops when dropped.
#[derive(Debug)]
pub struct OtlpReceiver {
    addr: std::net::SocketAddr,
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    count: Arc<AtomicU64>,
    serve: AbortHandle,
}

impl OtlpReceiver {
    /// Starts on a free loopback port; `keep`: keep every span (tests), or only count them
    /// (benchmarks).
    pub async fn start(keep: bool) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let addr = listener.local_addr().expect("bound address");
        let sink = Sink {
            keep,
            spans: Arc::default(),
            count: Arc::default(),
        };
        let (spans, count) = (sink.spans.clone(), sink.count.clone());
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        let router = tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(sink).max_decoding_message_size(64 << 20));
        let serve = tokio::spawn(async move {
            let _ = router.serve_with_incoming(incoming).await;
        })
        .abort_handle();
        Self {
            addr,
            spans,
            count,
            serve,
        }
    }

    /// `http://127.0.0.1:PORT`, what `--trace-endpoint` takes.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The spans kept so far.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().map(|s| s.clone()).unwrap_or_default()
    }

    /// Spans received so far (kept or not).
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    /// Waits until a kept span matches `what` (the binaries export every 2 s), or panics with
    /// what arrived.
    pub async fn wait_for(
        &self,
        describe: &str,
        what: impl Fn(&ReceivedSpan) -> bool,
    ) -> ReceivedSpan {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(s) = self.spans().into_iter().find(|s| what(s)) {
                return s;
            }
            if tokio::time::Instant::now() > deadline {
                let names: Vec<String> = self
                    .spans()
                    .iter()
                    .map(|s| format!("{}/{} {}", s.service, s.name, s.trace_id))
                    .collect();
                panic!("no span {describe} arrived in 30 s; received: {names:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.serve.abort();
    }
}
