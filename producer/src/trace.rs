//! The producer's run is a trace (docs/tracing.md): with tracing on, `producer run` is the root
//! span, each stream's run its child, and every message it enqueues carries the context of the
//! span that wrote it, so the dispatcher's send span and the consumer's handler continue it.

use opentelemetry::trace::TraceContextExt as _;
use outbox_shared::{TraceContext, TraceParent};
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// The current span's context as a message carries it; `None` when tracing is off.
pub(crate) fn current_context() -> Option<TraceContext> {
    if !outbox_runtime::traces::on() {
        return None;
    }
    let cx = tracing::Span::current().context();
    let span = cx.span();
    let sc = span.span_context();
    if !sc.is_valid() {
        return None;
    }
    let traceparent = TraceParent {
        trace_id: sc.trace_id().to_bytes(),
        span_id: sc.span_id().to_bytes(),
        flags: sc.trace_flags().to_u8(),
    };
    let state = sc.trace_state().header();
    Some(TraceContext::new(traceparent.to_string()).with_tracestate(state))
}
