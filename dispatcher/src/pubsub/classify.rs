//! Publish failures as values with a reason: every message ends published, retried later
//! (transient), dead-lettered (its own fault), held with its topic (the topic is refused as a
//! whole) or slowed down (quota). One table, [`CODES`], says what each gRPC code means; it is
//! docs/dispatcher.md's failure table too (a test holds the two together).

pub use tonic::Code;

use crate::pubsub::transport::Failed;

/// What a failed publish means for the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// May succeed later: retry on the row's schedule (an attempt is charged).
    Transient,
    /// The message's own fault (Pub/Sub refused what it holds): isolated, then dead-lettered.
    Permanent,
    /// The topic, not the message, is refused (no permission yet, not created yet, its key
    /// disabled, a proxy that does not route it): every request to it would fail alike. The
    /// topic is held (`crate::refusals::hold`): its rows go back untouched, nothing is charged or
    /// dead-lettered, and a probe releases it once Pub/Sub accepts it.
    TopicRefused,
    /// Quota or flow control (RESOURCE_EXHAUSTED): the topic slows down (`crate::refusals::pace`)
    /// and the rows wait a little without an attempt charged.
    Throttled,
    /// Never sent (an earlier request of its ordering key failed in the same batch): release the
    /// row untouched, no attempt is charged.
    NotAttempted,
}

impl FailureKind {
    /// Every kind: the metrics register each one's series at zero from this list (a test names
    /// every kind exhaustively and checks its series).
    pub const ALL: [Self; 5] = [
        Self::Transient,
        Self::Permanent,
        Self::TopicRefused,
        Self::Throttled,
        Self::NotAttempted,
    ];

    /// Label used in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Transient => "transient",
            Self::Permanent => "permanent",
            Self::TopicRefused => "topic_refused",
            Self::Throttled => "throttled",
            Self::NotAttempted => "not_attempted",
        }
    }

    /// Whether the failure charges the row an attempt (only a transient one does; a permanent
    /// one dead-letters it).
    pub fn charges_an_attempt(self) -> bool {
        matches!(self, Self::Transient)
    }
}

/// A failed publish of one message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishFailure {
    /// What it means.
    pub kind: FailureKind,
    /// What happened, for the row's `last_error` and for operators.
    pub message: String,
}

impl PublishFailure {
    /// A transient failure with a message.
    pub fn transient(message: impl Into<String>) -> Self {
        Self {
            kind: FailureKind::Transient,
            message: message.into(),
        }
    }

    /// A permanent failure with a message.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self {
            kind: FailureKind::Permanent,
            message: message.into(),
        }
    }
}

/// What each gRPC status a `Publish` may come back with means, in the codes' order: the code,
/// its kind, and why (docs/dispatcher.md, "Failures", is this table). A status a proxy made from
/// its HTTP answer follows tonic's mapping (401 UNAUTHENTICATED, 403 PERMISSION_DENIED, 404
/// UNIMPLEMENTED, 429/502/503/504 UNAVAILABLE, other 4xx/5xx INTERNAL or UNKNOWN).
pub const CODES: [(Code, FailureKind, &str); 17] = {
    use FailureKind::{Permanent, Throttled, TopicRefused, Transient};
    [
        (
            Code::Ok,
            Transient,
            "an answer without a result: sent again",
        ),
        (
            Code::Cancelled,
            Transient,
            "the call was cancelled on the way",
        ),
        (
            Code::Unknown,
            Transient,
            "a server or proxy error without a code",
        ),
        (
            Code::InvalidArgument,
            Permanent,
            "the message itself: it breaks the topic's schema or a limit; isolated, then dead-lettered",
        ),
        (Code::DeadlineExceeded, Transient, "no answer in time"),
        (
            Code::NotFound,
            TopicRefused,
            "the topic does not exist (yet): created after its writers, or deleted",
        ),
        (
            Code::AlreadyExists,
            Permanent,
            "never sent by Publish; if it is, the message is isolated like any refused one",
        ),
        (
            Code::PermissionDenied,
            TopicRefused,
            "no pubsub.topics.publish on the topic: a grant still propagating (minutes), or missing",
        ),
        (
            Code::ResourceExhausted,
            Throttled,
            "quota or flow control: the topic slows down, no attempt is charged",
        ),
        (
            Code::FailedPrecondition,
            TopicRefused,
            "the topic cannot take messages now: its CMEK key disabled or destroyed",
        ),
        (
            Code::Aborted,
            Transient,
            "a conflict on the server: sent again",
        ),
        (
            Code::OutOfRange,
            Permanent,
            "never sent by Publish; if it is, the message is isolated like any refused one",
        ),
        (
            Code::Unimplemented,
            TopicRefused,
            "a proxy or endpoint that does not serve Publish (an HTTP 404 on the way)",
        ),
        (Code::Internal, Transient, "a server error"),
        (
            Code::Unavailable,
            Transient,
            "Pub/Sub or the way to it is down (the breaker probes)",
        ),
        (Code::DataLoss, Transient, "a server error"),
        (
            Code::Unauthenticated,
            Transient,
            "an expired or refused token: a credentials outage, not the message's (the breaker probes)",
        ),
    ]
};

/// Maps a gRPC status code to a failure kind ([`CODES`]).
pub fn classify_code(code: Code) -> FailureKind {
    CODES[code as usize].1
}

/// The canonical name of a code (`NOT_FOUND`), as Google's documents and consoles write it.
pub fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// Classifies why a request got no result; every message of the request shares it (a request
/// is atomic: one refused message fails all of them, and isolation finds which).
pub fn classify(failed: &Failed) -> PublishFailure {
    match failed {
        Failed::Answered(status) => PublishFailure {
            kind: classify_code(status.code()),
            message: format!("{}: {}", code_name(status.code()), status.message()),
        },
        Failed::NoAnswer(what) => PublishFailure::transient(what.clone()),
        Failed::Credentials(why) => {
            PublishFailure::transient(format!("cannot get credentials for Pub/Sub: {why}"))
        }
        Failed::NotSent(why) => PublishFailure::permanent(format!(
            "refused before sending (check the topic name and the message): {why}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use tonic::Status;

    use super::*;

    #[test]
    fn every_grpc_code_has_its_kind_and_name_and_the_topic_level_ones_hold_the_topic() {
        use FailureKind::{Permanent as P, Throttled as Q, TopicRefused as H, Transient as T};
        let table = [
            (Code::Ok, T, "OK"),
            (Code::Cancelled, T, "CANCELLED"),
            (Code::Unknown, T, "UNKNOWN"),
            (Code::InvalidArgument, P, "INVALID_ARGUMENT"),
            (Code::DeadlineExceeded, T, "DEADLINE_EXCEEDED"),
            (Code::NotFound, H, "NOT_FOUND"),
            (Code::AlreadyExists, P, "ALREADY_EXISTS"),
            (Code::PermissionDenied, H, "PERMISSION_DENIED"),
            (Code::ResourceExhausted, Q, "RESOURCE_EXHAUSTED"),
            (Code::FailedPrecondition, H, "FAILED_PRECONDITION"),
            (Code::Aborted, T, "ABORTED"),
            (Code::OutOfRange, P, "OUT_OF_RANGE"),
            (Code::Unimplemented, H, "UNIMPLEMENTED"),
            (Code::Internal, T, "INTERNAL"),
            (Code::Unavailable, T, "UNAVAILABLE"),
            (Code::DataLoss, T, "DATA_LOSS"),
            (Code::Unauthenticated, T, "UNAUTHENTICATED"),
        ];
        assert_eq!(table.len(), 17, "every code gRPC defines");
        for (i, (code, kind, name)) in table.into_iter().enumerate() {
            assert_eq!(code as usize, i, "the table is in the codes' order");
            assert_eq!(CODES[i].0, code, "CODES is in the codes' order");
            assert_eq!(classify_code(code), kind, "{name}");
            assert_eq!(code_name(code), name);
            let failure = classify(&Failed::Answered(Status::new(code, "why")));
            assert_eq!(failure.kind, kind, "{name}");
            assert_eq!(failure.message, format!("{name}: why"));
            assert_eq!(
                kind.charges_an_attempt(),
                kind == T,
                "{name}: only a transient failure charges an attempt"
            );
        }
    }

    #[test]
    fn docs_dispatcher_md_lists_every_code_with_the_kind_of_this_table() {
        let doc = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docs/dispatcher.md"
        ))
        .expect("read docs/dispatcher.md");
        for (code, kind, _) in CODES {
            let name = code_name(code);
            let row = doc
                .lines()
                .find(|l| l.starts_with(&format!("| `{name}` |")))
                .unwrap_or_else(|| panic!("docs/dispatcher.md has no row for `{name}`"));
            assert!(
                row.contains(&format!("| {} |", kind.as_str())),
                "docs/dispatcher.md says otherwise of {name} (want {}): {row}",
                kind.as_str()
            );
        }
    }

    #[test]
    fn no_answer_and_no_credentials_are_transient_a_request_not_sent_is_permanent() {
        let no_answer = classify(&Failed::NoAnswer("cannot connect: refused".into()));
        assert_eq!(no_answer.kind, FailureKind::Transient);
        assert_eq!(no_answer.message, "cannot connect: refused");
        let creds = classify(&Failed::Credentials("token endpoint down".into()));
        assert_eq!(creds.kind, FailureKind::Transient);
        assert!(creds.message.contains("credentials"), "{}", creds.message);
        let not_sent = classify(&Failed::NotSent("bad topic".into()));
        assert_eq!(not_sent.kind, FailureKind::Permanent);
        assert!(
            not_sent.message.contains("before sending"),
            "{}",
            not_sent.message
        );
    }
}
