//! The publishing seam between a batch and Pub/Sub: [`Publish`] (publish a claimed batch and get
//! one result per message, in order; probe whether the broker answers). `crate::pubsub::publisher`
//! is the one on Pub/Sub's transport, `crate::pubsub::fault` a fault injector in front of it, and
//! tests bring their own. [`Attempt`] is what became of each claimed message on its way to it:
//! the word the batch's steps, its decision and the refusals (storms, quota) learn from.

use std::future::Future;

use outbox_shared::ClaimedMessage;

use crate::pubsub::classify::PublishFailure;

/// One result per message of a batch, in the batch's order: the Pub/Sub message id or why not.
pub type BatchResult = Vec<Result<String, PublishFailure>>;

/// The publishing seam between the worker and Pub/Sub.
pub trait Publish: Send + Sync + 'static {
    /// Publishes `batch` in requests of its own (no message of another call shares them: a
    /// batch of one is a message alone); returns one result per message, in order.
    fn publish(&self, batch: &[ClaimedMessage]) -> impl Future<Output = BatchResult> + Send;
    /// Whether the broker answers at all (used to tell an outage from a bad message).
    fn probe(&self, topic: &str) -> impl Future<Output = Result<(), ProbeError>> + Send;
    /// The attribute it adds to every message, carrying the dedupe key (the batch counts it
    /// against Pub/Sub's attribute limits before publishing).
    fn dedupe_attribute(&self) -> &str;
}

/// Why a probe did not confirm that Pub/Sub answers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProbeError {
    /// No answer (refused connection, timeout, transport failure): an outage, claiming pauses.
    #[error("{0}")]
    Unreachable(String),
    /// The request could not be sent at all (a topic name that cannot be a header value): a
    /// configuration error, never an outage.
    #[error("the request to Pub/Sub could not be sent: {0}")]
    Refused(String),
}

impl ProbeError {
    /// Whether this means Pub/Sub is unreachable (rather than the request being wrong).
    pub fn is_outage(&self) -> bool {
        matches!(self, Self::Unreachable(_))
    }
}

/// What happened to one claimed message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Attempt {
    /// Refused by the local limit checks (never sent).
    Rejected(String),
    /// Not sent: an earlier message of its key was not published.
    HeldBack,
    /// Published with this Pub/Sub message id.
    Published(String),
    /// The publish failed.
    Failed(PublishFailure),
}

/// A message's result from [`Publish::publish`].
impl From<Result<String, PublishFailure>> for Attempt {
    fn from(result: Result<String, PublishFailure>) -> Self {
        match result {
            Ok(message_id) => Self::Published(message_id),
            Err(failure) => Self::Failed(failure),
        }
    }
}
