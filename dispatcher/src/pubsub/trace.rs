//! The writer's trace, continued through the publish (docs/tracing.md).
//!
//! **Checked once per batch** ([`vet`]): a row's context is parsed and put in the form it is sent
//! in by `outbox_shared`'s one parser (`TraceContext::normalize`); a malformed one, or one with
//! no room left among the message's attributes, is dropped with a warning (at most one a
//! second, counted in `outbox_trace_context_ignored_total`) and the message goes out without it.
//!
//! **One send span per traced message** ([`Sends`]), a child of the writer's context, only when
//! tracing is on and the writer sampled its trace (parent-based sampling: an unsampled parent
//! gives an unsampled child, so the SDK is skipped and the writer's context is passed on as it
//! is). The message's `googclient_traceparent` then points at that span, so the consumer's
//! handler is its child. Per message rather than one span per batch with links: a handler can
//! only be the child of a span in its own trace, and a batch mixes many writers' traces. What it
//! costs is measured in BENCHMARKS.md ("Tracing"); a message without a context costs one branch,
//! and with tracing off nothing is allocated for any message.

use opentelemetry::trace::{
    Link, Span as _, SpanContext, SpanId, SpanKind, Status, TraceContextExt as _, TraceFlags,
    TraceId, TraceState, Tracer as _,
};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::trace::{SdkTracer, Span};
use outbox_shared::ClaimedMessage;
use outbox_shared::limits::{MAX_ATTRIBUTES, MAX_MESSAGE_BYTES};
use outbox_shared::trace::{TRACEPARENT_ATTRIBUTE, TRACESTATE_ATTRIBUTE, TraceParent};
use prometheus_client::metrics::counter::Counter;

use crate::log_gate::LogGate;
use crate::pubsub::classify::PublishFailure;

/// Checks the trace context of every claimed row (module documentation): keeps a valid one
/// (version 00's form, a valid `tracestate` or none) and drops the rest, warning once a second.
/// A row's own `googclient_traceparent`/`googclient_tracestate` attributes give way to its
/// context. Each dropped context counts on `ignored` (`outbox_trace_context_ignored_total`).
pub(crate) fn vet(
    claimed: &mut [ClaimedMessage],
    dedupe_attribute: &str,
    ignored: &Counter,
    gate: &LogGate,
) {
    for m in claimed.iter_mut() {
        let Some(context) = m.trace_context.as_mut() else {
            continue;
        };
        let why = match context.normalize() {
            Err(e) => Some(e.to_string()),
            Ok(_) => {
                m.attributes.remove(TRACEPARENT_ATTRIBUTE);
                m.attributes.remove(TRACESTATE_ATTRIBUTE);
                no_room(m, dedupe_attribute)
            }
        };
        if let Some(why) = why {
            m.trace_context = None;
            ignored.inc();
            if let Some(held_back) = gate.pass() {
                tracing::warn!(
                    outbox.id = m.id, outbox.dedupe_key = %m.dedupe_key, pubsub.topic = %m.topic,
                    held_back, error = %why,
                    "A row's trace context was ignored: the message is published without it. \
                     Fix what its writer stores in pubsub_outbox.traceparent (docs/tracing.md)."
                );
            }
        }
    }
}

/// Why `m` cannot carry its trace attributes within Pub/Sub's limits, if it cannot.
fn no_room(m: &ClaimedMessage, dedupe_attribute: &str) -> Option<String> {
    let context = m.trace_context.as_ref()?;
    let trace: usize = 1 + usize::from(context.tracestate.is_some());
    let dedupe = usize::from(!m.attributes.contains_key(dedupe_attribute));
    let count = m.attributes.len() + dedupe + trace;
    if count > MAX_ATTRIBUTES {
        return Some(format!(
            "the message has {} attributes with the dedupe attribute; the trace attributes would \
             make {count}, and Pub/Sub accepts {MAX_ATTRIBUTES}",
            count - trace
        ));
    }
    let size = m.payload.len()
        + m.attributes
            .iter()
            .map(|(k, v)| k.len() + v.len())
            .sum::<usize>()
        + dedupe_attribute.len()
        + m.dedupe_key.len()
        + m.ordering_key.as_deref().map_or(0, str::len)
        + TRACEPARENT_ATTRIBUTE.len()
        + context.traceparent.len()
        + context
            .tracestate
            .as_deref()
            .map_or(0, |s| TRACESTATE_ATTRIBUTE.len() + s.len());
    (size > MAX_MESSAGE_BYTES).then(|| {
        format!("with the trace attributes the message would be {size} bytes; Pub/Sub accepts {MAX_MESSAGE_BYTES}")
    })
}

/// The send spans of one publish request, one per message whose writer sampled its trace (none
/// when tracing is off: then nothing is allocated).
#[derive(Default)]
pub(crate) struct Sends {
    /// By position in the request.
    spans: Vec<Option<Send>>,
}

struct Send {
    span: Span,
    /// The span's own context, as `googclient_traceparent` carries it.
    traceparent: String,
}

impl Sends {
    /// Starts the spans of the request of `batch[of]` to `topic` (module documentation).
    pub(crate) fn start(
        tracer: Option<&SdkTracer>,
        batch: &[ClaimedMessage],
        of: &[usize],
        topic: &str,
    ) -> Self {
        let Some(tracer) = tracer else {
            return Self::default();
        };
        let mut spans: Vec<Option<Send>> = Vec::new();
        let mut batch_span: Option<SpanContext> = None;
        for (n, i) in of.iter().enumerate() {
            let m = &batch[*i];
            let Some(context) = m.trace_context.as_ref() else {
                continue;
            };
            let Ok(parent) = context.parse() else {
                continue;
            };
            if !parent.sampled() {
                continue;
            }
            if spans.is_empty() {
                spans.resize_with(of.len(), || None);
                batch_span = Some(current_span());
            }
            let span = start(
                tracer,
                m,
                &parent,
                context.tracestate.as_deref(),
                topic,
                of.len(),
                batch_span.as_ref(),
            );
            let sc = span.span_context();
            let traceparent = TraceParent {
                trace_id: sc.trace_id().to_bytes(),
                span_id: sc.span_id().to_bytes(),
                flags: sc.trace_flags().to_u8(),
            }
            .to_string();
            spans[n] = Some(Send { span, traceparent });
        }
        Self { spans }
    }

    /// The `googclient_traceparent` of the request's `n`th message when it has a span of its own
    /// (otherwise the writer's, as stored).
    pub(crate) fn traceparent(&self, n: usize) -> Option<&str> {
        self.spans
            .get(n)
            .and_then(Option::as_ref)
            .map(|s| s.traceparent.as_str())
    }

    /// Ends the spans with the request's results (one per message, in order).
    pub(crate) fn end(self, results: &[Result<String, PublishFailure>]) {
        for (send, result) in self.spans.into_iter().zip(results) {
            let Some(Send { mut span, .. }) = send else {
                continue;
            };
            match result {
                Ok(id) => span.set_attribute(KeyValue::new("messaging.message.id", id.clone())),
                Err(failure) => {
                    span.set_attribute(KeyValue::new("error.type", failure.kind.as_str()));
                    span.set_status(Status::error(failure.message.clone()));
                }
            }
            span.end();
        }
    }
}

/// The OpenTelemetry context of the current `tracing` span (the batch's publish step).
fn current_span() -> SpanContext {
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;
    tracing::Span::current()
        .context()
        .span()
        .span_context()
        .clone()
}

/// One message's send span: `send <topic id>`, kind producer, a child of the writer's context,
/// linked to the batch's publish step, with the messaging conventions' attributes.
fn start(
    tracer: &SdkTracer,
    m: &ClaimedMessage,
    parent: &TraceParent,
    tracestate: Option<&str>,
    topic: &str,
    request_size: usize,
    batch_span: Option<&SpanContext>,
) -> Span {
    let state = tracestate
        .and_then(|s| s.parse::<TraceState>().ok())
        .unwrap_or_default();
    let remote = SpanContext::new(
        TraceId::from_bytes(parent.trace_id),
        SpanId::from_bytes(parent.span_id),
        TraceFlags::new(parent.flags),
        true,
        state,
    );
    let cx = Context::new().with_remote_span_context(remote);
    let (project, topic_id) = split_topic(topic);
    let mut attributes = vec![
        KeyValue::new("messaging.system", "gcp_pubsub"),
        KeyValue::new("messaging.operation.type", "send"),
        KeyValue::new("messaging.operation.name", "send"),
        KeyValue::new("messaging.destination.name", topic_id.to_owned()),
        KeyValue::new("gcp.project_id", project.to_owned()),
        KeyValue::new("messaging.batch.message_count", request_size as i64),
        KeyValue::new("messaging.message.body.size", m.payload.len() as i64),
        KeyValue::new("outbox.id", m.id),
        KeyValue::new("outbox.attempt", i64::from(m.attempts) + 1),
        KeyValue::new("outbox.dedupe_key", m.dedupe_key.clone()),
    ];
    if let Some(key) = m.ordering_key.as_deref() {
        attributes.push(KeyValue::new(
            "messaging.gcp_pubsub.message.ordering_key",
            key.to_owned(),
        ));
    }
    let links = batch_span
        .filter(|sc| sc.is_valid())
        .map(|sc| vec![Link::with_context(sc.clone())])
        .unwrap_or_default();
    tracer
        .span_builder(format!("send {topic_id}"))
        .with_kind(SpanKind::Producer)
        .with_attributes(attributes)
        .with_links(links)
        .start_with_context(tracer, &cx)
}

/// (project, topic id) of `projects/<project>/topics/<topic>`.
fn split_topic(topic: &str) -> (&str, &str) {
    let mut parts = topic.split('/');
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some("projects"), Some(project), Some("topics"), Some(id)) => (project, id),
        _ => ("", topic),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use outbox_shared::TraceContext;

    const PARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    fn row(id: i64, context: Option<&str>) -> ClaimedMessage {
        ClaimedMessage {
            id,
            topic: "projects/p/topics/t".to_owned(),
            ordering_key: None,
            dedupe_key: format!("d{id}"),
            payload: bytes::Bytes::from_static(b"x"),
            attributes: Default::default(),
            trace_context: context.map(TraceContext::new),
            attempts: 0,
            created_at: chrono::Utc::now(),
        }
    }

    #[test]
    fn vetting_keeps_valid_contexts_drops_malformed_ones_and_makes_room() {
        let ignored = Counter::default();
        let gate = LogGate::new(std::time::Duration::from_secs(1));
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra";
        let mut crowded = row(4, Some(PARENT));
        for a in 0..99 {
            crowded.attributes.insert(format!("a{a}"), "v".to_owned());
        }
        let mut own = row(5, Some(PARENT));
        own.attributes
            .insert(TRACEPARENT_ATTRIBUTE.to_owned(), "stale".to_owned());
        let mut rows = vec![
            row(1, Some(PARENT)),
            row(2, Some("not-a-traceparent")),
            row(3, Some(later)),
            crowded,
            own,
            row(6, None),
        ];
        vet(&mut rows, "dedupe_key", &ignored, &gate);
        let kept: Vec<Option<&str>> = rows
            .iter()
            .map(|m| m.trace_context.as_ref().map(|c| c.traceparent.as_str()))
            .collect();
        assert_eq!(
            kept,
            [Some(PARENT), None, Some(PARENT), None, Some(PARENT), None],
            "a later version is kept in version 00's form; 99 attributes + dedupe leave no room"
        );
        assert!(
            !rows[4].attributes.contains_key(TRACEPARENT_ATTRIBUTE),
            "the column wins over the row's own attribute"
        );
        assert_eq!(ignored.get(), 2);
    }

    #[test]
    fn without_a_tracer_nothing_is_started_and_nothing_allocated() {
        let rows = vec![row(1, Some(PARENT)), row(2, None)];
        let sends = Sends::start(None, &rows, &[0, 1], "projects/p/topics/t");
        assert_eq!(sends.spans.capacity(), 0);
        assert_eq!(sends.traceparent(0), None);
    }

    #[test]
    fn a_sampled_writer_gets_a_child_span_and_an_unsampled_one_is_passed_on() {
        let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder().build();
        let tracer = opentelemetry::trace::TracerProvider::tracer(&provider, "test");
        let unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00";
        let rows = vec![row(1, Some(PARENT)), row(2, Some(unsampled)), row(3, None)];
        let sends = Sends::start(Some(&tracer), &rows, &[0, 1, 2], "projects/p/topics/t");
        let child =
            TraceParent::parse(sends.traceparent(0).expect("a span of its own")).expect("valid");
        assert_eq!(
            child.trace_id,
            TraceParent::parse(PARENT).expect("p").trace_id
        );
        assert_ne!(
            child.span_id,
            TraceParent::parse(PARENT).expect("p").span_id
        );
        assert!(child.sampled());
        assert_eq!(sends.traceparent(1), None, "the writer's own is sent");
        assert_eq!(sends.traceparent(2), None);
        sends.end(&[
            Ok("m1".to_owned()),
            Ok("m2".to_owned()),
            Ok("m3".to_owned()),
        ]);
    }
}
