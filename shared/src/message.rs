//! The messages that move through the outbox.
//!
//! A [`NewMessage`] is what a writer enqueues; a [`ClaimedMessage`] is what the dispatcher holds
//! while publishing. The payload is opaque bytes: the outbox never looks inside.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use crate::trace::TraceContext;

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
    /// The writer's W3C trace context (`traceparent`, `tracestate`), if it writes inside a
    /// trace: the dispatcher's send span continues it, and the consumer receives it as
    /// `googclient_traceparent` (docs/tracing.md).
    pub trace_context: Option<TraceContext>,
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
            trace_context: None,
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

    /// Carries the writer's trace context (e.g. what an OpenTelemetry `TraceContextPropagator`
    /// injects for the current span): the message's trace continues through the dispatcher to
    /// the consumer.
    pub fn with_trace_context(mut self, context: TraceContext) -> Self {
        self.trace_context = Some(context);
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
    /// The message data (shared, not copied, when the message is cloned or published).
    pub payload: bytes::Bytes,
    /// Pub/Sub attributes stored with the row.
    pub attributes: Attributes,
    /// The writer's trace context, as stored (unchecked: the dispatcher checks it).
    pub trace_context: Option<TraceContext>,
    /// Failed attempts so far.
    pub attempts: i32,
    /// When the row was enqueued (for end-to-end lag).
    pub created_at: DateTime<Utc>,
}

/// Why a topic name cannot be published to.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TopicNameError {
    /// Empty, or with white space.
    #[error("{0:?} is not a topic name: use a short name or projects/<project>/topics/<topic>")]
    Invalid(String),
    /// Starts like a full name but is not `projects/<project>/topics/<topic>`.
    #[error("{0:?} is not projects/<project>/topics/<topic>")]
    Malformed(String),
    /// A short name, and no project to complete it.
    #[error(
        "{0:?} is a short topic name and no project is set: set --pubsub-project \
         (PUBSUB_PROJECT_ID) or use the full name projects/<project>/topics/{0}"
    )]
    NoProject(String),
    /// The project or topic id breaks Pub/Sub's resource-name rules.
    #[error("{name:?} is not a Pub/Sub topic name: {rule}")]
    Grammar {
        /// The full name.
        name: String,
        /// The rule it breaks.
        rule: &'static str,
    },
}

/// The full topic name for `topic`: a full name as it is, a short one in `project`. Checked
/// against the template the Pub/Sub client and the outbox's CHECK constraint enforce
/// (`projects/<project>/topics/<topic>`) and against Pub/Sub's resource-name rules (a topic id
/// of 3 to 255 letters, digits and `-._~%+`, starting with a letter, not with `goog`; a project
/// id of 6 to 30 lowercase letters, digits and hyphens, starting with a letter, not ending with a
/// hyphen, optionally behind a `domain:` prefix), so a name Pub/Sub would refuse is refused here,
/// with the rule it breaks.
pub fn resolve_topic(project: &str, topic: &str) -> Result<String, TopicNameError> {
    if topic.is_empty() || topic.contains(char::is_whitespace) {
        return Err(TopicNameError::Invalid(topic.to_owned()));
    }
    let full = if topic.starts_with("projects/") {
        topic.to_owned()
    } else if topic.contains('/') {
        return Err(TopicNameError::Invalid(topic.to_owned()));
    } else if project.is_empty() {
        return Err(TopicNameError::NoProject(topic.to_owned()));
    } else {
        format!("projects/{project}/topics/{topic}")
    };
    let parts: Vec<&str> = full.split('/').collect();
    let valid =
        parts.len() == 4 && parts[2] == "topics" && !parts[1].is_empty() && !parts[3].is_empty();
    if !valid {
        return Err(TopicNameError::Malformed(full));
    }
    match project_rule(parts[1]).or_else(|| topic_rule(parts[3])) {
        Some(rule) => Err(TopicNameError::Grammar { name: full, rule }),
        None => Ok(full),
    }
}

/// The project-id rule `project` breaks, if any.
fn project_rule(project: &str) -> Option<&'static str> {
    let id = project.rsplit_once(':').map_or(project, |(_, id)| id);
    let chars_ok = id
        .chars()
        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if !(6..=30).contains(&id.len()) || !chars_ok {
        Some("a project id has 6 to 30 lowercase letters, digits or hyphens")
    } else if !id.starts_with(|c: char| c.is_ascii_lowercase()) || id.ends_with('-') {
        Some("a project id starts with a letter and does not end with a hyphen")
    } else {
        None
    }
}

/// The topic-id rule `id` breaks, if any.
fn topic_rule(id: &str) -> Option<&'static str> {
    let chars_ok = id
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "-._~%+".contains(c));
    if !(3..=255).contains(&id.len()) || !chars_ok {
        Some("a topic id has 3 to 255 letters, digits or -._~%+")
    } else if !id.starts_with(|c: char| c.is_ascii_alphabetic()) {
        Some("a topic id starts with a letter")
    } else if id.to_ascii_lowercase().starts_with("goog") {
        Some("a topic id must not start with \"goog\"")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::{TopicNameError, resolve_topic};

    #[test]
    fn short_topic_names_get_the_project_prefix() {
        assert_eq!(
            resolve_topic("ops-project", "orders").as_deref(),
            Ok("projects/ops-project/topics/orders")
        );
        assert_eq!(
            resolve_topic("", "projects/example.com:billing-prod/topics/in_v.1~%+").as_deref(),
            Ok("projects/example.com:billing-prod/topics/in_v.1~%+")
        );
    }

    #[test]
    fn names_the_client_would_refuse_are_refused_with_the_fix() {
        assert_eq!(
            resolve_topic("", "orders"),
            Err(TopicNameError::NoProject("orders".into()))
        );
        let no_project = resolve_topic("", "orders")
            .expect_err("no project")
            .to_string();
        assert!(
            no_project.contains("PUBSUB_PROJECT_ID")
                && no_project.contains("projects/<project>/topics/orders")
        );
        for bad in [
            "projects//topics/t",
            "projects/p/topics/",
            "projects/p/subscriptions/t",
            "projects/p/topics/t/x",
        ] {
            assert_eq!(
                resolve_topic("p", bad),
                Err(TopicNameError::Malformed(bad.into())),
                "{bad}"
            );
        }
        for bad in ["", "a b", "a/b"] {
            assert_eq!(
                resolve_topic("p", bad),
                Err(TopicNameError::Invalid(bad.into())),
                "{bad:?}"
            );
        }
        for bad in [
            "projects/p/topics/orders",
            "projects/Ops-Project/topics/orders",
            "projects/ops-project-/topics/orders",
            "projects/ops-project/topics/or",
            "projects/ops-project/topics/1orders",
            "projects/ops-project/topics/google-orders",
            "projects/ops-project/topics/orders!",
        ] {
            assert!(
                matches!(resolve_topic("", bad), Err(TopicNameError::Grammar { .. })),
                "{bad}"
            );
        }
    }
}
