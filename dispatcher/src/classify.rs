//! Publish failures as values with a reason: every message ends published, retried later
//! (transient), or dead-lettered (permanent). One function maps gRPC codes to these.

use google_cloud_gax::error::rpc::Code;
use google_cloud_pubsub::error::PublishError;

/// What a failed publish means for the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FailureKind {
    /// May succeed later: retry on the row's schedule.
    Transient,
    /// Cannot succeed: dead-letter now.
    Permanent,
    /// Never sent (the client paused the ordering key, or was shutting down): release the row
    /// untouched, no attempt is charged.
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
/// not dead-letter the backlog (the circuit breaker catches a persistent one).
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
        | Code::Unauthenticated => FailureKind::Transient,
        Code::InvalidArgument
        | Code::NotFound
        | Code::PermissionDenied
        | Code::AlreadyExists
        | Code::FailedPrecondition
        | Code::OutOfRange
        | Code::Unimplemented => FailureKind::Permanent,
        // OK is not a failure; an unknown future code is safest retried.
        _ => FailureKind::Transient,
    }
}

/// Whether the client refused a request before sending anything: a resource name that does not
/// match its template (`is_binding`) or a request it cannot encode. Nothing reached Pub/Sub, so
/// this is never an outage; the request itself (its configuration) is wrong.
pub fn refused_before_sending(e: &google_cloud_gax::error::Error) -> bool {
    e.is_binding() || e.is_serialization()
}

/// A client error without a gRPC status (no answer, a broken connection) for people: what the
/// client tried, and the innermost cause (`connection refused (os error 111)`), rather than the
/// client's own text, which embeds its transport's status and metadata as debug dumps.
pub fn describe(e: &google_cloud_gax::error::Error) -> String {
    let what = if e.is_timeout() {
        "no answer within the deadline"
    } else if e.is_connect() {
        "cannot connect"
    } else if e.is_authentication() {
        "cannot get credentials"
    } else if let Some(code) = e.http_status_code() {
        return format!("HTTP {code} from Pub/Sub or a proxy before it");
    } else {
        "the connection failed"
    };
    let mut innermost = None;
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        innermost = Some(c);
        cause = c.source();
    }
    match innermost.map(ToString::to_string) {
        Some(text) if !text.is_empty() => format!("{what}: {text}"),
        _ => what.to_owned(),
    }
}

/// Classifies an error returned by the Pub/Sub client for one message.
pub fn classify(error: &PublishError) -> PublishFailure {
    match error {
        PublishError::Rpc(e) if refused_before_sending(e) => PublishFailure::permanent(format!(
            "refused by the Pub/Sub client before sending (check the topic name and the message): {e}"
        )),
        PublishError::Rpc(e) => {
            let kind = match e.status() {
                Some(status) => classify_code(status.code),
                // No gRPC status: transport, I/O, timeout, authentication or HTTP-level failure.
                None => match e.http_status_code() {
                    Some(400 | 403 | 404) => FailureKind::Permanent,
                    _ => FailureKind::Transient,
                },
            };
            let message = match e.status() {
                Some(status) => format!("{}: {}", status.code.name(), status.message),
                None => describe(e),
            };
            PublishFailure { kind, message }
        }
        PublishError::OrderingKeyPaused => PublishFailure {
            kind: FailureKind::NotAttempted,
            message: "ordering key paused after an earlier failure in the same batch".to_owned(),
        },
        PublishError::Shutdown => PublishFailure {
            kind: FailureKind::NotAttempted,
            message: "publisher shut down before sending".to_owned(),
        },
        other => PublishFailure::transient(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_transport_failure_reads_as_its_innermost_cause_not_a_debug_dump() {
        #[derive(Debug, thiserror::Error)]
        #[error(
            "status: Unavailable, message: \"error trying to connect\", details: [], metadata: MetadataMap {{ headers: {{}} }}"
        )]
        struct Dump(#[source] std::io::Error);
        let refused = std::io::Error::from(std::io::ErrorKind::ConnectionRefused);
        let text = refused.to_string();
        let e = google_cloud_gax::error::Error::connect(Dump(refused));
        let said = describe(&e);
        assert_eq!(said, format!("cannot connect: {text}"));
        assert!(!said.contains("MetadataMap"), "{said}");
        let timeout = google_cloud_gax::error::Error::timeout(Dump(std::io::Error::from(
            std::io::ErrorKind::TimedOut,
        )));
        assert!(describe(&timeout).starts_with("no answer within the deadline: "));
    }
    use google_cloud_gax::error::rpc::Status;
    use std::sync::Arc;

    #[test]
    fn every_grpc_code_has_the_documented_kind() {
        use FailureKind::{Permanent as P, Transient as T};
        let table = [
            (Code::Cancelled, T),
            (Code::Unknown, T),
            (Code::InvalidArgument, P),
            (Code::DeadlineExceeded, T),
            (Code::NotFound, P),
            (Code::AlreadyExists, P),
            (Code::PermissionDenied, P),
            (Code::ResourceExhausted, T),
            (Code::FailedPrecondition, P),
            (Code::Aborted, T),
            (Code::OutOfRange, P),
            (Code::Unimplemented, P),
            (Code::Internal, T),
            (Code::Unavailable, T),
            (Code::DataLoss, T),
            (Code::Unauthenticated, T),
        ];
        for (code, kind) in table {
            assert_eq!(classify_code(code), kind, "{}", code.name());
        }
    }

    #[test]
    fn rpc_errors_carry_the_code_name_and_message() {
        let err = PublishError::Rpc(Arc::new(google_cloud_gax::error::Error::service(
            Status::default()
                .set_code(Code::NotFound)
                .set_message("Topic not found"),
        )));
        let failure = classify(&err);
        assert_eq!(failure.kind, FailureKind::Permanent);
        assert_eq!(failure.message, "NOT_FOUND: Topic not found");
    }

    #[test]
    fn a_request_the_client_refuses_before_sending_is_permanent_not_an_outage() {
        let err = PublishError::Rpc(Arc::new(google_cloud_gax::error::Error::binding(
            "field `topic` should match the template",
        )));
        let failure = classify(&err);
        assert_eq!(failure.kind, FailureKind::Permanent);
        assert!(
            failure.message.contains("before sending"),
            "{}",
            failure.message
        );
    }

    #[test]
    fn transport_errors_are_transient() {
        let err = PublishError::Rpc(Arc::new(google_cloud_gax::error::Error::io(
            "connection refused",
        )));
        assert_eq!(classify(&err).kind, FailureKind::Transient);
    }

    #[test]
    fn paused_keys_and_shutdown_charge_no_attempt() {
        assert_eq!(
            classify(&PublishError::OrderingKeyPaused).kind,
            FailureKind::NotAttempted
        );
        assert_eq!(
            classify(&PublishError::Shutdown).kind,
            FailureKind::NotAttempted
        );
    }
}
