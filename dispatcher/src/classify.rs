//! Publish failures as values with a reason: every message ends published, retried later
//! (transient), or dead-lettered (permanent). One function maps gRPC codes to these.

pub use tonic::Code;

use crate::transport::Failed;

/// What a failed publish means for the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// May succeed later: retry on the row's schedule.
    Transient,
    /// Cannot succeed: dead-letter now.
    Permanent,
    /// Never sent (an earlier request of its ordering key failed in the same batch): release the
    /// row untouched, no attempt is charged.
    NotAttempted,
}

impl FailureKind {
    /// Label used in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Transient => "transient",
            Self::Permanent => "permanent",
            Self::NotAttempted => "not_attempted",
        }
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

/// Maps a gRPC status code to a failure kind.
///
/// Transient: the request may succeed unchanged later. Permanent: the request itself is wrong
/// (bad argument, missing topic, no permission) and only an operator can fix it.
/// UNAUTHENTICATED is transient: it is how an expired token shows, and a credentials outage must
/// not dead-letter the backlog (the circuit breaker catches a persistent one). A status a proxy
/// made from its HTTP answer follows tonic's mapping (401 UNAUTHENTICATED, 403 PERMISSION_DENIED,
/// 404 UNIMPLEMENTED, 429/502/503/504 UNAVAILABLE, other 4xx/5xx INTERNAL or UNKNOWN).
pub fn classify_code(code: Code) -> FailureKind {
    match code {
        Code::Unavailable
        | Code::DeadlineExceeded
        | Code::ResourceExhausted
        | Code::Internal
        | Code::Aborted
        | Code::Unknown
        | Code::Cancelled
        | Code::DataLoss
        | Code::Unauthenticated
        // OK is not a failure: an answer that says OK without a result is retried.
        | Code::Ok => FailureKind::Transient,
        Code::InvalidArgument
        | Code::NotFound
        | Code::PermissionDenied
        | Code::AlreadyExists
        | Code::FailedPrecondition
        | Code::OutOfRange
        | Code::Unimplemented => FailureKind::Permanent,
    }
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
    fn every_grpc_code_has_the_documented_kind_and_name() {
        use FailureKind::{Permanent as P, Transient as T};
        let table = [
            (Code::Ok, T, "OK"),
            (Code::Cancelled, T, "CANCELLED"),
            (Code::Unknown, T, "UNKNOWN"),
            (Code::InvalidArgument, P, "INVALID_ARGUMENT"),
            (Code::DeadlineExceeded, T, "DEADLINE_EXCEEDED"),
            (Code::NotFound, P, "NOT_FOUND"),
            (Code::AlreadyExists, P, "ALREADY_EXISTS"),
            (Code::PermissionDenied, P, "PERMISSION_DENIED"),
            (Code::ResourceExhausted, T, "RESOURCE_EXHAUSTED"),
            (Code::FailedPrecondition, P, "FAILED_PRECONDITION"),
            (Code::Aborted, T, "ABORTED"),
            (Code::OutOfRange, P, "OUT_OF_RANGE"),
            (Code::Unimplemented, P, "UNIMPLEMENTED"),
            (Code::Internal, T, "INTERNAL"),
            (Code::Unavailable, T, "UNAVAILABLE"),
            (Code::DataLoss, T, "DATA_LOSS"),
            (Code::Unauthenticated, T, "UNAUTHENTICATED"),
        ];
        assert_eq!(table.len(), 17, "every code gRPC defines");
        for (i, (code, kind, name)) in table.into_iter().enumerate() {
            assert_eq!(code as usize, i, "the table is in the codes' order");
            assert_eq!(classify_code(code), kind, "{name}");
            assert_eq!(code_name(code), name);
            let failure = classify(&Failed::Answered(Status::new(code, "why")));
            assert_eq!(failure.kind, kind, "{name}");
            assert_eq!(failure.message, format!("{name}: why"));
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
