//! The messages that move through the outbox.
//!
//! A [`NewMessage`] is what a writer enqueues; a [`ClaimedMessage`] is what the dispatcher holds
//! while publishing. The payload is opaque bytes: the outbox never looks inside.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

/// Pub/Sub attributes: string keys to string values, sorted for stable output.
pub type Attributes = BTreeMap<String, String>;

/// A message to enqueue into `pubsub_outbox`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewMessage {
    /// Full topic name, `projects/<project>/topics/<topic>`.
    pub topic: String,
    /// Messages sharing (topic, ordering key) are published in enqueue order.
    pub ordering_key: Option<String>,
    /// Stable identity of the message: enqueueing the same key twice is a no-op, and consumers
    /// receive it as an attribute to drop duplicates.
    pub dedupe_key: String,
    /// The message data.
    pub payload: Vec<u8>,
    /// Pub/Sub attributes.
    pub attributes: Attributes,
}

impl NewMessage {
    /// A message without ordering key or attributes.
    pub fn new(topic: impl Into<String>, dedupe_key: impl Into<String>, payload: Vec<u8>) -> Self {
        Self {
            topic: topic.into(),
            ordering_key: None,
            dedupe_key: dedupe_key.into(),
            payload,
            attributes: Attributes::new(),
        }
    }

    /// Publishes this message in order with the others of `key` on its topic.
    pub fn with_ordering_key(mut self, key: impl Into<String>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// Adds a Pub/Sub attribute.
    pub fn with_attribute(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.attributes.insert(key.into(), value.into());
        self
    }
}

/// A row claimed by the dispatcher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimedMessage {
    /// `pubsub_outbox.id`.
    pub id: i64,
    /// Full topic name.
    pub topic: String,
    /// Ordering key, if any.
    pub ordering_key: Option<String>,
    /// Dedupe key.
    pub dedupe_key: String,
    /// The message data.
    pub payload: Vec<u8>,
    /// Pub/Sub attributes stored with the row.
    pub attributes: Attributes,
    /// Failed attempts so far.
    pub attempts: i32,
    /// When the row was enqueued (for end-to-end lag).
    pub created_at: DateTime<Utc>,
}

/// Returns the full topic name for `topic` in `project`, accepting an already full name.
pub fn full_topic_name(project: &str, topic: &str) -> String {
    if topic.starts_with("projects/") {
        topic.to_owned()
    } else {
        format!("projects/{project}/topics/{topic}")
    }
}

#[cfg(test)]
mod tests {
    use super::full_topic_name;

    #[test]
    fn short_topic_names_get_the_project_prefix() {
        assert_eq!(full_topic_name("p", "t"), "projects/p/topics/t");
        assert_eq!(
            full_topic_name("p", "projects/q/topics/t"),
            "projects/q/topics/t"
        );
    }
}
