//! Pub/Sub's hard limits (cloud.google.com/pubsub/quotas), checked locally so a message that can
//! never be published is rejected without a network round trip and never blocks good ones.

use crate::message::Attributes;

/// Maximum message size (data + attributes + ordering key) and maximum request size, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 10_000_000;
/// Maximum messages in one publish request.
pub const MAX_MESSAGES_PER_REQUEST: usize = 1_000;
/// Maximum attributes per message.
pub const MAX_ATTRIBUTES: usize = 100;
/// Maximum attribute key length in bytes.
pub const MAX_ATTRIBUTE_KEY_BYTES: usize = 256;
/// Maximum attribute value length in bytes.
pub const MAX_ATTRIBUTE_VALUE_BYTES: usize = 1_024;
/// Maximum ordering key length in bytes.
pub const MAX_ORDERING_KEY_BYTES: usize = 1_024;

/// Why a message can never be published.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LimitViolation {
    /// Data plus attributes exceed the message size limit.
    #[error(
        "message is {size} bytes (data + attributes + ordering key); Pub/Sub accepts at most {MAX_MESSAGE_BYTES}"
    )]
    TooLarge {
        /// The size found.
        size: usize,
    },
    /// Too many attributes (the dedupe attribute counts).
    #[error(
        "message has {count} attributes (including the dedupe attribute); Pub/Sub accepts at most {MAX_ATTRIBUTES}"
    )]
    TooManyAttributes {
        /// The count found.
        count: usize,
    },
    /// An attribute key is too long or empty.
    #[error("attribute key {key:?} is {len} bytes; Pub/Sub accepts 1 to {MAX_ATTRIBUTE_KEY_BYTES}")]
    AttributeKey {
        /// The key (truncated for display).
        key: String,
        /// Its length.
        len: usize,
    },
    /// An attribute value is too long.
    #[error(
        "attribute {key:?} has a {len}-byte value; Pub/Sub accepts at most {MAX_ATTRIBUTE_VALUE_BYTES}"
    )]
    AttributeValue {
        /// The key.
        key: String,
        /// The value length.
        len: usize,
    },
    /// The ordering key is too long.
    #[error("ordering key is {len} bytes; Pub/Sub accepts at most {MAX_ORDERING_KEY_BYTES}")]
    OrderingKey {
        /// Its length.
        len: usize,
    },
    /// The dedupe key is missing.
    #[error("dedupe key is empty; every message needs a stable dedupe key")]
    MissingDedupeKey,
    /// Pub/Sub rejects a message with neither data nor attributes.
    #[error("message has no data and no attributes; Pub/Sub requires at least one")]
    Empty,
}

/// Checks a message against Pub/Sub's limits, counting the dedupe attribute
/// (`dedupe_attribute` = `dedupe_key`) the dispatcher adds.
pub fn check_publishable(
    payload: &[u8],
    attributes: &Attributes,
    ordering_key: Option<&str>,
    dedupe_attribute: &str,
    dedupe_key: &str,
) -> Result<(), LimitViolation> {
    if dedupe_key.is_empty() {
        return Err(LimitViolation::MissingDedupeKey);
    }
    let extra = usize::from(!attributes.contains_key(dedupe_attribute));
    let count = attributes.len() + extra;
    if count > MAX_ATTRIBUTES {
        return Err(LimitViolation::TooManyAttributes { count });
    }
    let all = attributes
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .chain(std::iter::once((dedupe_attribute, dedupe_key)));
    let mut size = payload.len();
    for (key, value) in all {
        if key.is_empty() || key.len() > MAX_ATTRIBUTE_KEY_BYTES {
            return Err(LimitViolation::AttributeKey {
                key: key.chars().take(64).collect(),
                len: key.len(),
            });
        }
        if value.len() > MAX_ATTRIBUTE_VALUE_BYTES {
            return Err(LimitViolation::AttributeValue {
                key: key.chars().take(64).collect(),
                len: value.len(),
            });
        }
        size += key.len() + value.len();
    }
    if let Some(key) = ordering_key {
        if key.len() > MAX_ORDERING_KEY_BYTES {
            return Err(LimitViolation::OrderingKey { len: key.len() });
        }
        size += key.len();
    }
    if size > MAX_MESSAGE_BYTES {
        return Err(LimitViolation::TooLarge { size });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn attrs(n: usize) -> Attributes {
        (0..n).map(|i| (format!("k{i}"), "v".to_owned())).collect()
    }

    #[test]
    fn a_normal_message_passes() {
        assert_eq!(
            check_publishable(b"x", &attrs(3), Some("key"), "dedupe_key", "d1"),
            Ok(())
        );
    }

    #[test]
    fn each_limit_is_enforced_at_its_boundary() {
        let at_limit = vec![0u8; MAX_MESSAGE_BYTES - "dedupe_key".len() - 2];
        assert_eq!(
            check_publishable(&at_limit, &attrs(0), None, "dedupe_key", "d1"),
            Ok(())
        );
        let over = vec![0u8; MAX_MESSAGE_BYTES];
        assert!(matches!(
            check_publishable(&over, &attrs(0), None, "dedupe_key", "d1"),
            Err(LimitViolation::TooLarge { .. })
        ));
        assert_eq!(
            check_publishable(b"x", &attrs(99), None, "dedupe_key", "d"),
            Ok(())
        );
        assert_eq!(
            check_publishable(b"x", &attrs(100), None, "dedupe_key", "d"),
            Err(LimitViolation::TooManyAttributes { count: 101 })
        );
        let mut long_key = Attributes::new();
        long_key.insert("k".repeat(257), "v".into());
        assert!(matches!(
            check_publishable(b"x", &long_key, None, "dedupe_key", "d"),
            Err(LimitViolation::AttributeKey { len: 257, .. })
        ));
        let mut long_value = Attributes::new();
        long_value.insert("k".into(), "v".repeat(1025));
        assert!(matches!(
            check_publishable(b"x", &long_value, None, "dedupe_key", "d"),
            Err(LimitViolation::AttributeValue { len: 1025, .. })
        ));
        let key = "o".repeat(1025);
        assert_eq!(
            check_publishable(b"x", &attrs(0), Some(&key), "dedupe_key", "d"),
            Err(LimitViolation::OrderingKey { len: 1025 })
        );
        assert_eq!(
            check_publishable(b"x", &attrs(0), None, "dedupe_key", ""),
            Err(LimitViolation::MissingDedupeKey)
        );
    }

    #[test]
    fn an_overlong_dedupe_key_is_an_attribute_value_violation() {
        let dedupe = "d".repeat(1025);
        assert!(matches!(
            check_publishable(b"x", &attrs(0), None, "dedupe_key", &dedupe),
            Err(LimitViolation::AttributeValue { len: 1025, .. })
        ));
    }
}
