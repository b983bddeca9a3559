//! What the unit tests of several modules share: a claimed message made up for a table test.

use outbox_shared::ClaimedMessage;

/// Message `id` of `topic` (ordering key `key`, `attempts` charged), dedupe key `d<id>`, an
/// empty payload, enqueued at a fixed instant.
pub(crate) fn message(id: i64, topic: &str, key: Option<&str>, attempts: i32) -> ClaimedMessage {
    ClaimedMessage {
        id,
        topic: topic.to_owned(),
        ordering_key: key.map(str::to_owned),
        dedupe_key: format!("d{id}"),
        payload: bytes::Bytes::new(),
        attributes: Default::default(),
        trace_context: None,
        attempts,
        created_at: chrono::DateTime::UNIX_EPOCH,
    }
}
