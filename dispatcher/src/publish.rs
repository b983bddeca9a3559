//! The publishing seam between a batch and Pub/Sub: [`Publish`] (publish a claimed batch and get
//! one result per message, in order; probe whether the broker answers). `crate::publisher` is
//! the one on Pub/Sub's transport, `crate::fault` a fault injector in front of it, and tests
//! bring their own.

use std::future::Future;

use outbox_shared::ClaimedMessage;

use crate::classify::PublishFailure;

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
