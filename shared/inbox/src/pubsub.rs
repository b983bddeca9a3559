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

use std::collections::HashMap;
use std::fmt::Display;
use std::hash::{BuildHasher, BuildHasherDefault, DefaultHasher};
use std::time::{Duration, Instant};

use google_cloud_pubsub::model::Message;
use google_cloud_pubsub::subscriber::MessageStream;
use google_cloud_pubsub::subscriber::handler::Handler;
use sqlx::PgConnection;
use tokio::sync::mpsc;

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
    let outcome = match dedupe_key(message, attribute) {
        Some(key) => inbox.process(consumer, key, handler).await,
        None => {
            inbox.count_failure();
            Outcome::Failed(Failure::Inbox(Error::MissingDedupeKey {
                attribute: attribute.to_owned(),
            }))
        }
    };
    if outcome.should_ack() {
        ack.ack();
    } else {
        ack.nack();
    }
    outcome
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
    /// Stop when no message arrived for this long (batch drains, demos); `None`: run until
    /// `shutdown`.
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
}

/// Messages waiting per lane; beyond that the stream is not read (the client's flow control).
const LANE_CAPACITY: usize = 32;

/// Reads `stream` until `shutdown` completes, the stream ends, or it was idle for
/// `stop_when_idle`; runs every message through the inbox with `handler` (given the message
/// and the transaction), keeping per-key order (module documentation). On the way out it stops
/// reading, lets the lanes finish the messages they hold and waits for the client to send the
/// pending acks. Returns the stream's error if it failed permanently.
pub async fn consume<E: Display>(
    inbox: &Inbox,
    mut stream: MessageStream,
    options: &ConsumeOptions,
    handler: impl AsyncFn(&Message, &mut PgConnection) -> Result<(), E>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), google_cloud_pubsub::Error> {
    let lanes = options.lanes.max(1);
    let (senders, receivers): (Vec<_>, Vec<_>) =
        (0..lanes).map(|_| mpsc::channel(LANE_CAPACITY)).unzip();
    let token = stream.shutdown_token();
    let router = async move {
        let mut shutdown = std::pin::pin!(shutdown);
        let mut round_robin = 0usize;
        let hasher = BuildHasherDefault::<DefaultHasher>::default();
        let result = loop {
            let next = async {
                match options.stop_when_idle {
                    Some(idle) => tokio::time::timeout(idle, stream.next())
                        .await
                        .ok()
                        .flatten(),
                    None => stream.next().await,
                }
            };
            let next = tokio::select! {
                biased;
                () = &mut shutdown => break Ok(()),
                next = next => next,
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
            if senders[lane].send((message, ack)).await.is_err() {
                break Ok(());
            }
        };
        // No more messages for the lanes; they finish what they hold, then the client flushes.
        drop(senders);
        token.shutdown().await;
        result
    };
    let workers = futures::future::join_all(
        receivers
            .into_iter()
            .map(|rx| lane(inbox, options, rx, &handler)),
    );
    let (result, _) = tokio::join!(router, workers);
    result
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
    mut rx: mpsc::Receiver<(Message, Handler)>,
    handler: &impl AsyncFn(&Message, &mut PgConnection) -> Result<(), E>,
) {
    let mut holds: HashMap<String, Hold> = HashMap::new();
    while let Some((message, ack)) = rx.recv().await {
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
                continue;
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
}
