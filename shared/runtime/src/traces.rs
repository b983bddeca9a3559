//! Traces: the OpenTelemetry pipeline of the long-running commands (`dispatcher run`, `producer
//! run`), off by default (docs/tracing.md).
//!
//! With `--trace-endpoint` set, `tracing` spans become OpenTelemetry spans (the
//! `tracing-opentelemetry` bridge) and are exported over OTLP/gRPC in batches: to a collector
//! (`http://otel-collector:4317`), or to Cloud Trace's OTLP endpoint
//! (`https://telemetry.googleapis.com`) with the workload's Application Default Credentials
//! (scope `trace.append`, role `roles/cloudtrace.agent`). Sampling is parent-based: a span whose
//! parent (the writer's context, carried in the row) was sampled is sampled; a new trace is
//! sampled with `--trace-sample-ratio`. Without `--trace-endpoint` nothing is built: no layer,
//! no exporter, no cost.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use opentelemetry::KeyValue;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{WithExportConfig, WithTonicConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};

/// The tracing flags of `run` (both binaries).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TraceArgs {
    /// Export traces over OTLP/gRPC to this endpoint: a collector (http://otel-collector:4317)
    /// or Cloud Trace (https://telemetry.googleapis.com, with the workload's credentials).
    /// Unset: tracing is off (the writer's context is still passed on to the consumer).
    #[arg(long, env = "OUTBOX_TRACE_ENDPOINT", value_parser = endpoint)]
    pub trace_endpoint: Option<String>,
    /// The share of new traces sampled, 0 to 1 (parent-based: a message whose writer sampled
    /// its trace is always sampled, one whose writer did not never is).
    #[arg(
        long,
        env = "OUTBOX_TRACE_SAMPLE_RATIO",
        default_value_t = 0.1,
        value_parser = ratio
    )]
    pub trace_sample_ratio: f64,
    /// The Google Cloud project the traces belong to: JSON logs name traces
    /// projects/PROJECT/traces/ID (Cloud Logging joins them), and Cloud Trace files spans under
    /// it. Default: GOOGLE_CLOUD_PROJECT, else PUBSUB_PROJECT_ID.
    #[arg(long, env = "OUTBOX_TRACE_PROJECT")]
    pub trace_project: Option<String>,
}

impl TraceArgs {
    /// The project the traces belong to (flag, then the environment's project).
    pub fn project(&self) -> Option<String> {
        self.trace_project
            .clone()
            .or_else(|| std::env::var("GOOGLE_CLOUD_PROJECT").ok())
            .or_else(|| std::env::var("PUBSUB_PROJECT_ID").ok())
            .filter(|p| !p.is_empty())
    }
}

/// Accepts an http(s) URL with a host.
fn endpoint(s: &str) -> Result<String, String> {
    let fix = "e.g. http://otel-collector:4317 (a collector) or https://telemetry.googleapis.com (Cloud Trace)";
    let uri: http::Uri = s
        .parse()
        .map_err(|e| format!("{s:?} is not a URL ({e}); {fix}"))?;
    match (uri.scheme_str(), uri.host()) {
        (Some("http" | "https"), Some(_)) => Ok(s.trim_end_matches('/').to_owned()),
        _ => Err(format!(
            "{s:?} is not an http:// or https:// URL with a host; {fix}"
        )),
    }
}

/// Accepts a ratio from 0 to 1.
fn ratio(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(format!(
            "{s:?} is not a sampling ratio: give a number from 0 (no new trace) to 1 (every one)"
        )),
    }
}

/// Why the trace pipeline could not be built (a configuration error: exit 2).
#[derive(Debug, thiserror::Error)]
pub enum TracesError {
    /// The exporter refused its settings.
    #[error(
        "the OTLP trace exporter for {endpoint} cannot be built: {reason}; fix --trace-endpoint (OUTBOX_TRACE_ENDPOINT) or unset it to turn tracing off"
    )]
    Exporter {
        /// The endpoint.
        endpoint: String,
        /// Why.
        reason: String,
    },
    /// Cloud Trace needs credentials and there are none.
    #[error(
        "{endpoint} is Google's and no Application Default Credentials were found ({reason}): run with a service account that has roles/cloudtrace.agent (Workload Identity on GKE, the service's account on Cloud Run), or export to a collector instead"
    )]
    Credentials {
        /// The endpoint.
        endpoint: String,
        /// Why.
        reason: String,
    },
}

/// Whether this process exports traces (set once the pipeline is built).
static ON: AtomicBool = AtomicBool::new(false);

/// Whether this process exports traces: code that would build span events only for the export
/// asks first, so nothing is built when tracing is off.
pub fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// The trace pipeline of a process: none when tracing is off.
#[derive(Debug, Clone, Default)]
pub struct Traces {
    provider: Option<SdkTracerProvider>,
}

/// Batches of spans are exported at least this often.
const EXPORT_EVERY: Duration = Duration::from_secs(2);
/// An export that has not finished by then is abandoned (its spans are dropped, never retried
/// into memory without bound).
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// Spans waiting for export at most; more are dropped (and counted by the SDK), so a dead
/// collector never grows the process.
const MAX_QUEUED_SPANS: usize = 8192;
/// How long the exit waits for the last export (a dead collector does not hold the exit up).
const SHUTDOWN_WAIT: Duration = Duration::from_secs(5);
/// The OAuth scope of Cloud Trace's OTLP endpoint.
const TRACE_APPEND: &str = "https://www.googleapis.com/auth/trace.append";

impl Traces {
    /// Builds the pipeline `args` asks for, for `service` (`service.name`). Call inside the
    /// tokio runtime: the exporter's channel and the batch task live on it.
    pub async fn start(args: &TraceArgs, service: &'static str) -> Result<Self, TracesError> {
        let Some(endpoint) = args.trace_endpoint.as_deref() else {
            return Ok(Self::default());
        };
        let failed = |e: &dyn std::fmt::Display| TracesError::Exporter {
            endpoint: endpoint.to_owned(),
            reason: e.to_string(),
        };
        let project = args.project();
        let mut builder = opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .with_timeout(EXPORT_TIMEOUT);
        if endpoint.starts_with("https://") {
            builder = builder
                .with_tls_config(tonic::transport::ClientTlsConfig::new().with_native_roots());
        }
        if is_google(endpoint) {
            let headers = GoogleHeaders::start(endpoint, project.as_deref()).await?;
            builder = builder.with_interceptor(headers);
        }
        let exporter = builder.build().map_err(|e| failed(&e))?;
        let processor = opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
            exporter,
            opentelemetry_sdk::runtime::Tokio,
        )
        .with_batch_config(
            opentelemetry_sdk::trace::BatchConfigBuilder::default()
                .with_scheduled_delay(EXPORT_EVERY)
                .with_max_queue_size(MAX_QUEUED_SPANS)
                .build(),
        )
        .build();
        let mut resource = Resource::builder()
            .with_service_name(service)
            .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")));
        if let Some(project) = project {
            resource = resource.with_attribute(KeyValue::new("gcp.project_id", project));
        }
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                args.trace_sample_ratio,
            ))))
            .with_resource(resource.build())
            .build();
        opentelemetry::global::set_tracer_provider(provider.clone());
        ON.store(true, Ordering::Relaxed);
        Ok(Self {
            provider: Some(provider),
        })
    }

    /// Whether spans are exported.
    pub fn enabled(&self) -> bool {
        self.provider.is_some()
    }

    /// A tracer of this process (none when tracing is off).
    pub fn tracer(&self, scope: &'static str) -> Option<SdkTracer> {
        self.provider.as_ref().map(|p| p.tracer(scope))
    }

    /// Exports what is queued and stops the pipeline (at exit; at most [`SHUTDOWN_WAIT`]).
    pub async fn shutdown(&self) {
        let Some(provider) = self.provider.clone() else {
            return;
        };
        let flushed = tokio::task::spawn_blocking(move || provider.shutdown());
        match tokio::time::timeout(SHUTDOWN_WAIT, flushed).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "The last spans could not be exported."),
            _ => tracing::warn!("The last spans were not exported in time; they are dropped."),
        }
    }
}

/// Whether `endpoint` is one of Google's (it takes the workload's OAuth token).
fn is_google(endpoint: &str) -> bool {
    endpoint
        .parse::<http::Uri>()
        .ok()
        .and_then(|u| {
            u.host()
                .map(|h| h == "googleapis.com" || h.ends_with(".googleapis.com"))
        })
        .unwrap_or(false)
}

/// The headers Cloud Trace's OTLP endpoint takes (`authorization`, and `x-goog-user-project`
/// with a project), refreshed in the background: the exporter's interceptor is synchronous and
/// only copies the latest ones.
#[derive(Clone)]
struct GoogleHeaders {
    latest: Arc<RwLock<http::HeaderMap>>,
}

/// How often the token headers are asked for (google-cloud-auth caches and refreshes the token
/// itself; this only picks up the refreshed one).
const REFRESH_EVERY: Duration = Duration::from_secs(60);

impl GoogleHeaders {
    async fn start(endpoint: &str, project: Option<&str>) -> Result<Self, TracesError> {
        let refused = |reason: String| TracesError::Credentials {
            endpoint: endpoint.to_owned(),
            reason,
        };
        let credentials = google_cloud_auth::credentials::Builder::default()
            .with_scopes([TRACE_APPEND])
            .build()
            .map_err(|e| refused(e.to_string()))?;
        let mut fixed = http::HeaderMap::new();
        if let Some(project) = project
            && let Ok(value) = http::HeaderValue::from_str(project)
        {
            fixed.insert("x-goog-user-project", value);
        }
        let latest = Arc::new(RwLock::new(fixed.clone()));
        let shared = Arc::clone(&latest);
        tokio::spawn(async move {
            loop {
                match credentials.headers(http::Extensions::new()).await {
                    Ok(google_cloud_auth::credentials::CacheableResource::New { data, .. }) => {
                        let mut headers = fixed.clone();
                        headers.extend(data);
                        if let Ok(mut latest) = shared.write() {
                            *latest = headers;
                        }
                    }
                    Ok(google_cloud_auth::credentials::CacheableResource::NotModified) => {}
                    Err(e) => tracing::warn!(
                        error = %e,
                        "No token for Cloud Trace: spans are refused until the credentials answer."
                    ),
                }
                tokio::time::sleep(REFRESH_EVERY).await;
            }
        });
        Ok(Self { latest })
    }
}

impl tonic::service::Interceptor for GoogleHeaders {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        if let Ok(latest) = self.latest.read() {
            let metadata = request.metadata_mut().as_mut();
            for (name, value) in latest.iter() {
                metadata.insert(name.clone(), value.clone());
            }
        }
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_and_ratios_are_checked_with_the_fix() {
        assert_eq!(
            endpoint("http://localhost:4317/").as_deref(),
            Ok("http://localhost:4317")
        );
        assert!(endpoint("https://telemetry.googleapis.com").is_ok());
        for bad in ["localhost:4317", "grpc://x:1", "not a url"] {
            let e = endpoint(bad).expect_err(bad);
            assert!(e.contains("otel-collector:4317"), "{e}");
        }
        assert_eq!(ratio("0.25"), Ok(0.25));
        assert!(ratio("1.5").is_err() && ratio("-0.1").is_err() && ratio("x").is_err());
        assert!(is_google("https://telemetry.googleapis.com"));
        assert!(!is_google("http://collector.example.com:4317"));
        assert!(!is_google("http://evilgoogleapis.com:4317"));
    }
}
