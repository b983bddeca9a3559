//! Logging: `text` for people, `json` for Cloud Logging (one object per line with `severity`,
//! `time`, `message`, `target`, the event's fields, the fields of every enclosing span flattened
//! onto the line, and the span names in `spans`).
//!
//! Span fields are flattened so Cloud Logging can filter on them (`jsonPayload.stream="orders"`
//! matches every line of that stream's run). On a name clash the event's own field wins, then
//! the innermost span's.

use std::fmt;

use tracing::field::{Field, Visit};
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::{JsonFields, Writer};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt as _;

use crate::traces::{TraceArgs, Traces, TracesError};

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line with a Cloud Logging `severity`.
    Json,
}

/// Logging settings shared by both binaries.
#[derive(Debug, Clone, clap::Args)]
pub struct TelemetryArgs {
    /// Log format: text (people) or json (Cloud Logging / GKE / Cloud Run).
    #[arg(long, env = "OUTBOX_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
    /// Log filter in tracing's EnvFilter syntax (e.g. "info,outbox_dispatcher=debug").
    #[arg(long, env = "OUTBOX_LOG", default_value = "info", value_parser = log_filter)]
    pub log_filter: String,
}

/// Accepts a filter only if tracing can parse it (an invalid one is refused, not replaced).
fn log_filter(s: &str) -> Result<String, String> {
    EnvFilter::try_new(s).map(|_| s.to_owned()).map_err(|e| {
        format!(
            "{s:?} is not a tracing filter ({e}); e.g. \"info\" or \"info,outbox_dispatcher=debug\""
        )
    })
}

/// Installs the global subscriber (logs only). Safe to call more than once (later calls do
/// nothing), so tests can call it freely.
pub fn init(args: &TelemetryArgs) {
    install(args, &Traces::default(), None);
}

/// Installs the global subscriber with `traces` (`crate::traces`): when tracing is on, `tracing`
/// spans become OpenTelemetry spans, and JSON lines inside one carry Cloud Logging's trace fields
/// (`logging.googleapis.com/trace` as `projects/<project>/traces/<id>`).
pub fn init_traced(args: &TelemetryArgs, traces: &Traces, project: Option<String>) {
    install(args, traces, project);
}

fn install(args: &TelemetryArgs, traces: &Traces, project: Option<String>) {
    let filter = EnvFilter::try_new(&args.log_filter).unwrap_or_else(|_| EnvFilter::new("info"));
    // Colour only for a person at a terminal (a file, a pipe or a log collector gets plain text),
    // and never under NO_COLOR (no-color.org: set and not empty).
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let otel = traces.tracer("pubsub-outbox").map(|tracer| {
        tracing_opentelemetry::layer()
            .with_tracer(tracer)
            .with_threads(false)
            .with_location(false)
    });
    let registry = tracing_subscriber::registry().with(filter).with(otel);
    let _ = match args.log_format {
        LogFormat::Text => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(ansi)
                    .with_writer(std::io::stderr),
            )
            .try_init(),
        LogFormat::Json => registry
            .with(
                tracing_subscriber::fmt::layer()
                    .with_ansi(false)
                    .fmt_fields(JsonFields::new())
                    .event_format(CloudJson {
                        traced: traces.enabled(),
                        trace_project: project,
                    })
                    .with_writer(std::io::stderr),
            )
            .try_init(),
    };
}

/// Starts the trace pipeline `args` asks for (none without them, or without an endpoint) and
/// installs the global subscriber with it ([`init_traced`]). A pipeline that
/// cannot be built is a configuration error: the logs are installed, and the error returned.
pub async fn start_with_logs(
    logs: &TelemetryArgs,
    args: Option<&TraceArgs>,
    service: &'static str,
) -> Result<Traces, TracesError> {
    let traces = match args {
        Some(args) => Traces::start(args, service).await,
        None => Ok(Traces::default()),
    };
    let project = args.and_then(TraceArgs::project);
    let installed = traces.as_ref().cloned().unwrap_or_default();
    init_traced(logs, &installed, project);
    if let Some(args) = args.filter(|_| installed.enabled()) {
        tracing::info!(
            trace.endpoint = args.trace_endpoint.as_deref().unwrap_or_default(),
            trace.sample_ratio = args.trace_sample_ratio,
            "Tracing on: spans are exported over OTLP (docs/tracing.md)."
        );
    }
    traces
}

/// Cloud Logging's severity names.
fn severity(level: &Level) -> &'static str {
    match *level {
        Level::ERROR => "ERROR",
        Level::WARN => "WARNING",
        Level::INFO => "INFO",
        Level::DEBUG | Level::TRACE => "DEBUG",
    }
}

/// A JSON event formatter with Cloud Logging's field names. Span fields are read as the span's
/// formatted fields: install it with `.fmt_fields(JsonFields::new())` (as [`init`] does) so they
/// are JSON; spans formatted otherwise contribute their names only. When `traced`, a line written
/// inside an OpenTelemetry span carries Cloud Logging's trace fields.
#[derive(Debug, Clone, Default)]
pub struct CloudJson {
    /// Whether spans are OpenTelemetry spans (tracing is on).
    pub traced: bool,
    /// The project of `logging.googleapis.com/trace` (`projects/<project>/traces/<id>`); without
    /// one the field holds the trace id alone.
    pub trace_project: Option<String>,
}

impl CloudJson {
    /// Cloud Logging's trace fields for the current OpenTelemetry span, if there is one.
    fn trace_fields(&self, fields: &mut serde_json::Map<String, serde_json::Value>) {
        use opentelemetry::trace::TraceContextExt as _;
        if !self.traced {
            return;
        }
        let cx = opentelemetry::Context::current();
        let span = cx.span();
        let sc = span.span_context();
        if !sc.is_valid() {
            return;
        }
        let trace = match &self.trace_project {
            Some(project) => format!("projects/{project}/traces/{}", sc.trace_id()),
            None => sc.trace_id().to_string(),
        };
        fields.insert("logging.googleapis.com/trace".into(), trace.into());
        fields.insert(
            "logging.googleapis.com/spanId".into(),
            sc.span_id().to_string().into(),
        );
        fields.insert(
            "logging.googleapis.com/trace_sampled".into(),
            sc.is_sampled().into(),
        );
    }
}

impl<S, N> FormatEvent<S, N> for CloudJson
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        let mut fields = EventFields(serde_json::Map::new());
        event.record(&mut fields);
        if let Some(scope) = ctx.event_scope() {
            let mut names = Vec::new();
            // Innermost first, so an inner span's field wins over an outer one's.
            for span in scope {
                names.push(span.name());
                let extensions = span.extensions();
                let Some(formatted) = extensions.get::<FormattedFields<N>>() else {
                    continue;
                };
                if let Ok(serde_json::Value::Object(span_fields)) =
                    serde_json::from_str::<serde_json::Value>(formatted.as_str())
                {
                    for (k, v) in span_fields {
                        fields.0.entry(k).or_insert(v);
                    }
                }
            }
            if !names.is_empty() {
                names.reverse();
                fields.0.insert("spans".into(), names.join(":").into());
            }
        }
        fields
            .0
            .insert("severity".into(), severity(meta.level()).into());
        fields.0.insert(
            "time".into(),
            chrono::Utc::now()
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
                .into(),
        );
        fields.0.insert("target".into(), meta.target().into());
        self.trace_fields(&mut fields.0);
        writeln!(writer, "{}", serde_json::Value::Object(fields.0))
    }
}

struct EventFields(serde_json::Map<String, serde_json::Value>);

impl Visit for EventFields {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0
            .insert(field.name().to_owned(), format!("{value:?}").into());
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.into());
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().to_owned(), value.into());
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().to_owned(), value.into());
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().to_owned(), value.into());
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().to_owned(), value.into());
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.0
            .insert(field.name().to_owned(), value.to_string().into());
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::severity;
    use tracing::Level;

    /// Where a test's subscriber writes its lines.
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buffer {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0.lock().expect("buffer").extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn json_lines_carry_severity_message_fields_and_spans() {
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .event_format(super::CloudJson::default())
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let span = tracing::info_span!("batch");
            let _guard = span.enter();
            tracing::warn!(outbox.id = 7, retried = true, "publish failed");
        });
        let text = String::from_utf8(buffer.0.lock().expect("buffer").clone()).expect("utf-8");
        let line: serde_json::Value =
            serde_json::from_str(text.trim()).expect("one JSON object per line");
        assert_eq!(line["severity"], "WARNING");
        assert_eq!(line["message"], "publish failed");
        assert_eq!(line["outbox.id"], 7);
        assert_eq!(line["retried"], true);
        assert_eq!(line["spans"], "batch");
        assert!(
            line["time"].as_str().is_some_and(|t| t.ends_with('Z')),
            "RFC 3339 UTC time: {line}"
        );
    }

    #[test]
    fn a_json_line_inside_a_stream_span_carries_the_stream_field() {
        let buffer = Buffer::default();
        let writer = buffer.clone();
        // As `init` installs it for --log-format json.
        let subscriber = tracing_subscriber::fmt()
            .fmt_fields(super::JsonFields::new())
            .event_format(super::CloudJson::default())
            .with_writer(move || writer.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let run = tracing::info_span!("run_stream", stream = "orders", run_id = 7);
            let _run = run.enter();
            let call = tracing::info_span!("call", run_id = 8, call = "jobs.query");
            let _call = call.enter();
            tracing::warn!(
                call = "overridden by the event",
                "A BigQuery call failed; retrying."
            );
        });
        let text = String::from_utf8(buffer.0.lock().expect("buffer").clone()).expect("utf-8");
        let line: serde_json::Value =
            serde_json::from_str(text.trim()).expect("one JSON object per line");
        assert_eq!(line["stream"], "orders", "the outer span's field: {line}");
        assert_eq!(
            line["run_id"], 8,
            "the inner span wins over the outer: {line}"
        );
        assert_eq!(
            line["call"], "overridden by the event",
            "the event wins: {line}"
        );
        assert_eq!(line["spans"], "run_stream:call");
        assert_eq!(line["message"], "A BigQuery call failed; retrying.");
    }

    #[test]
    fn levels_map_to_cloud_logging_severities() {
        assert_eq!(severity(&Level::WARN), "WARNING");
        assert_eq!(severity(&Level::TRACE), "DEBUG");
    }
}
