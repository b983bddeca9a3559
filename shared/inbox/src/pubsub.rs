//! The glue for the official `google-cloud-pubsub` subscriber (feature `pubsub`): a received
//! message and its ack handler go through [`Inbox::process`], and are acked only after the
//! commit; [`consume`] runs a streaming-pull stream through the inbox with per-key order.
//!
//! **Ordering.** With an ordered subscription Pub/Sub delivers the messages of an ordering key in
//! publish order. [`consume`] keeps that order into the database: messages of one key always go
//! to the same lane (a sequential worker), lanes run concurrently. When the handler fails on a
//! message of key K, the message is nacked and the lane **holds K**: K's later messages that are
//! already here are nacked without running the handler, until the failed message comes back
//! (Pub/Sub redelivers it, and then the messages after it of K: those already processed are
//! dropped as duplicates) or `hold_after_failure` passes (the redelivery may have gone to
//! another client). A message that fails every time therefore holds its key, as it holds the
//! outbox's: give the subscription a dead-letter policy to bound that.
//!
//! **Flow control and leases.** [`consume`] reads the stream as fast as it delivers and queues
//! the messages on their lanes, so every delivered message is at once under the client's lease
//! management (extended until it is acked or nacked). What bounds the queues is the stream's
//! flow control: build it with `set_max_outstanding_messages(options.max_outstanding_messages())`
//! ([`ConsumeOptions::max_outstanding_messages`]), so one consumer holds no more than its lanes
//! work through in a few seconds and the rest of the backlog stays available to other
//! consumers. Reading lazily instead would leave delivered messages unread in the HTTP/2
//! buffers, where nothing extends them: past the stream's ack deadline they are redelivered
//! while still queued. The Pub/Sub emulator makes that a collapse: it ignores flow control,
//! pushes 100 messages every 50 ms to every open stream, and starts each ack deadline when it
//! *sends* the message (docs/consuming.md, "The Pub/Sub emulator differs").

use std::collections::HashMap;
use std::fmt::Display;
use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use google_cloud_pubsub::model::Message;
use google_cloud_pubsub::subscriber::MessageStream;
use google_cloud_pubsub::subscriber::handler::Handler;
use sqlx::PgConnection;
use tokio::sync::mpsc;
use tracing::Instrument as _;

use crate::error::Error;
use crate::inbox::{Failure, Inbox, Outcome};

/// The dedupe key of `message`: its `attribute` attribute, unless missing or empty.
pub fn dedupe_key<'m>(message: &'m Message, attribute: &str) -> Option<&'m str> {
    message
        .attributes
        .get(attribute)
        .map(String::as_str)
        .filter(|k| !k.is_empty())
}

/// Processes one received message through the inbox for `consumer`, with its dedupe key taken
/// from `attribute`, and then acks it (processed or duplicate) or nacks it (failed, or no dedupe
/// key). The ack is sent only after the commit; a panic in `handler` drops `ack`, which nacks.
pub async fn process_message<E>(
    inbox: &Inbox,
    consumer: &str,
    attribute: &str,
    message: &Message,
    ack: Handler,
    handler: impl AsyncFnOnce(&mut PgConnection) -> Result<(), E>,
) -> Outcome<E> {
    let outcome = async {
        match dedupe_key(message, attribute) {
            Some(key) => inbox.process(consumer, key, handler).await,
            None => {
                inbox.count_failure();
                Outcome::Failed(Failure::Inbox(Error::MissingDedupeKey {
                    attribute: attribute.to_owned(),
                }))
            }
        }
    }
    .instrument(handler_span(message, consumer))
    .await;
    if outcome.should_ack() {
        ack.ack();
    } else {
        ack.nack();
    }
    outcome
}

/// The span a message is handled in: `process <consumer>`, kind consumer, with the messaging
/// conventions' attributes, and the child of the publisher's span when the message carries
/// `googclient_traceparent` (the dispatcher's send span, or a Google client library's). With
/// an OpenTelemetry layer in the application's subscriber (`tracing-opentelemetry`) the handler
/// continues the message's trace; without one it is a plain `tracing` span.
pub fn handler_span(message: &Message, consumer: &str) -> tracing::Span {
    use opentelemetry::trace::{
        SpanContext, SpanId, TraceContextExt as _, TraceFlags, TraceId, TraceState,
    };
    use outbox_shared::trace::{TRACEPARENT_ATTRIBUTE, TRACESTATE_ATTRIBUTE, TraceParent};
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    let span = tracing::info_span!(
        "process",
        otel.name = %format_args!("process {consumer}"),
        otel.kind = "consumer",
        messaging.system = "gcp_pubsub",
        messaging.operation.type = "process",
        messaging.consumer.group.name = consumer,
        messaging.message.id = %message.message_id,
        messaging.gcp_pubsub.message.ordering_key = %message.ordering_key,
    );
    let parent = message
        .attributes
        .get(TRACEPARENT_ATTRIBUTE)
        .and_then(|p| TraceParent::parse(p).ok());
    if let Some(parent) = parent {
        let state = message
            .attributes
            .get(TRACESTATE_ATTRIBUTE)
            .and_then(|s| s.parse::<TraceState>().ok())
            .unwrap_or_default();
        let remote = SpanContext::new(
            TraceId::from_bytes(parent.trace_id),
            SpanId::from_bytes(parent.span_id),
            TraceFlags::new(parent.flags),
            true,
            state,
        );
        // Refused only when the span was entered already, which it was not.
        let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote));
    }
    span
}

/// How [`consume`] runs.
#[derive(Debug, Clone)]
pub struct ConsumeOptions {
    /// The consumer name the inbox keys on (the subscription's name is a good one).
    pub consumer: String,
    /// The attribute carrying the dedupe key.
    pub dedupe_attribute: String,
    /// Sequential workers; the messages of one ordering key always share one. Messages without
    /// an ordering key are spread over all of them.
    pub lanes: usize,
    /// Stop when no message arrived for this long and the lanes are idle (batch drains,
    /// demos); `None`: run until `shutdown`.
    pub stop_when_idle: Option<Duration>,
    /// After a failure on an ordering key, how long its later messages are nacked at most while
    /// waiting for the failed message to come back.
    pub hold_after_failure: Duration,
}

impl ConsumeOptions {
    /// Defaults for `consumer`: the `dedupe_key` attribute, 8 lanes, no idle stop, 60 s holds.
    pub fn new(consumer: impl Into<String>) -> Self {
        Self {
            consumer: consumer.into(),
            dedupe_attribute: outbox_shared::DEFAULT_DEDUPE_ATTRIBUTE.to_owned(),
            lanes: 8,
            stop_when_idle: None,
            hold_after_failure: Duration::from_secs(60),
        }
    }

    /// The flow control to give the stream (`set_max_outstanding_messages`): what the lanes
    /// can work through while the client keeps the leases, and no more (module documentation).
    pub fn max_outstanding_messages(&self) -> i64 {
        (self.lanes.max(1) * MESSAGES_PER_LANE) as i64
    }
}

/// Outstanding messages per lane that [`ConsumeOptions::max_outstanding_messages`] allows.
const MESSAGES_PER_LANE: usize = 32;

type Delivery = (Message, Handler);

/// Reads `stream` until `shutdown` completes, the stream ends, or it was idle for
/// `stop_when_idle`; runs every message through the inbox with `handler` (given the message
/// and the transaction), keeping per-key order (module documentation). Build `stream` with
/// [`ConsumeOptions::max_outstanding_messages`] as its flow control: the messages are read as
/// they arrive and wait on their lanes.
///
/// At `shutdown` it stops reading, lets each lane finish the message in hand, nacks the
/// queued ones (redelivered at once, possibly to another consumer) and waits for the client to
/// send the pending acks. At idle or the end of the stream the lanes finish their queues first.
/// Returns the stream's error if it failed permanently.
pub async fn consume<E: Display>(
    inbox: &Inbox,
    mut stream: MessageStream,
    options: &ConsumeOptions,
    handler: impl AsyncFn(&Message, &mut PgConnection) -> Result<(), E>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), google_cloud_pubsub::Error> {
    let lanes = options.lanes.max(1);
    let (senders, receivers): (Vec<_>, Vec<_>) =
        (0..lanes).map(|_| mpsc::unbounded_channel()).unzip();
    // Routed but not yet processed (idle means none), and whether shutdown was asked.
    let pending = AtomicUsize::new(0);
    let stopping = AtomicBool::new(false);
    let token = stream.shutdown_token();
    let router = async {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut round_robin = 0usize;
        let hasher = BuildHasherDefault::<DefaultHasher>::default();
        let result = loop {
            let next = tokio::select! {
                biased;
                () = &mut shutdown => {
                    stopping.store(true, Ordering::SeqCst);
                    break Ok(());
                }
                next = next_unless_idle(&mut stream, options.stop_when_idle, &pending) => next,
            };
            let (message, ack) = match next {
                Some(Ok(received)) => received,
                Some(Err(e)) => break Err(e),
                None => break Ok(()),
            };
            let lane = if message.ordering_key.is_empty() {
                round_robin = round_robin.wrapping_add(1);
                round_robin % lanes
            } else {
                (hasher.hash_one(&message.ordering_key) % lanes as u64) as usize
            };
            pending.fetch_add(1, Ordering::SeqCst);
            if senders[lane].send((message, ack)).is_err() {
                break Ok(());
            }
        };
        // No more messages for the lanes; they empty their queues, then the client flushes.
        drop(senders);
        result
    };
    let workers = futures::future::join_all(receivers.into_iter().map(|rx| {
        lane(
            inbox,
            options,
            rx,
            &handler,
            Progress {
                pending: &pending,
                stopping: &stopping,
            },
        )
    }));
    let (result, _) = tokio::join!(router, workers);
    token.shutdown().await;
    result
}

/// The stream's next delivery; `None` once `idle` passed with no delivery and nothing pending.
async fn next_unless_idle(
    stream: &mut MessageStream,
    idle: Option<Duration>,
    pending: &AtomicUsize,
) -> Option<google_cloud_pubsub::Result<Delivery>> {
    let Some(idle) = idle else {
        return stream.next().await;
    };
    loop {
        match tokio::time::timeout(idle, stream.next()).await {
            Ok(next) => return next,
            // Still working through what arrived: a nacked message may yet come back.
            Err(_) if pending.load(Ordering::SeqCst) > 0 => continue,
            Err(_) => return None,
        }
    }
}

/// What the router and the lanes share.
#[derive(Clone, Copy)]
struct Progress<'a> {
    pending: &'a AtomicUsize,
    stopping: &'a AtomicBool,
}

/// A failed message whose key is held until it comes back.
struct Hold {
    message_id: String,
    since: Instant,
}

/// One sequential worker: processes its messages in arrival order, holding a key after a failure.
async fn lane<E: Display>(
    inbox: &Inbox,
    options: &ConsumeOptions,
    mut rx: mpsc::UnboundedReceiver<Delivery>,
    handler: &impl AsyncFn(&Message, &mut PgConnection) -> Result<(), E>,
    progress: Progress<'_>,
) {
    let mut holds: HashMap<String, Hold> = HashMap::new();
    while let Some((message, ack)) = rx.recv().await {
        handle(
            inbox,
            options,
            &mut holds,
            message,
            ack,
            handler,
            progress.stopping,
        )
        .await;
        progress.pending.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One message of a lane: nacked unprocessed after shutdown or while its key is held.
async fn handle<E: Display>(
    inbox: &Inbox,
    options: &ConsumeOptions,
    holds: &mut HashMap<String, Hold>,
    message: Message,
    ack: Handler,
    handler: &impl AsyncFn(&Message, &mut PgConnection) -> Result<(), E>,
    stopping: &AtomicBool,
) {
    if stopping.load(Ordering::SeqCst) {
        // Queued, not started: redelivered at once rather than processed during shutdown.
        ack.nack();
        return;
    }
    let key = &message.ordering_key;
    if let Some(hold) = holds.get(key) {
        if hold.message_id != message.message_id
            && hold.since.elapsed() < options.hold_after_failure
        {
            // Pub/Sub redelivers this after the failed message: processing it now would
            // apply the key's messages out of order.
            tracing::debug!(pubsub.ordering_key = %key, pubsub.message_id = %message.message_id,
                    "ordering key held after a failure; message nacked unprocessed");
            ack.nack();
            return;
        }
        holds.remove(key);
    }
    let outcome = process_message(
        inbox,
        &options.consumer,
        &options.dedupe_attribute,
        &message,
        ack,
        async |tx: &mut PgConnection| handler(&message, tx).await,
    )
    .await;
    if let Outcome::Failed(failure) = outcome {
        tracing::warn!(pubsub.message_id = %message.message_id,
                pubsub.ordering_key = %key, error = %failure,
                "message not processed; nacked for redelivery");
        if !key.is_empty() {
            holds.insert(
                key.clone(),
                Hold {
                    message_id: message.message_id.clone(),
                    since: Instant::now(),
                },
            );
        }
    }
}
