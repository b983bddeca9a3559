//! The dispatcher's typed errors. Messages say what failed and what to do.

use std::net::SocketAddr;
use std::time::Duration;

/// Errors the dispatcher can stop with.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DispatcherError {
    /// The Pub/Sub client could not be built.
    #[error(
        "cannot build the Pub/Sub client for {endpoint}: {reason}. Check Application Default \
         Credentials (Workload Identity on GKE), --pubsub-endpoint, or PUBSUB_EMULATOR_HOST"
    )]
    PubsubClient {
        /// The endpoint used.
        endpoint: String,
        /// Why.
        reason: String,
    },
    /// The Pub/Sub client refused the start-up probe before sending it.
    #[error(
        "{0}. This is a configuration error, not an outage: check the topic names (--topic, the \
         rows' topic column: projects/<project>/topics/<topic>) and the Pub/Sub settings"
    )]
    PubsubRefused(String),
    /// PostgreSQL could not be reached.
    #[error(transparent)]
    Connect(#[from] outbox_runtime::db::ConnectError),
    /// A database operation failed.
    #[error(transparent)]
    Store(#[from] outbox_shared::Error),
    /// The HTTP endpoints could not bind.
    #[error(
        "cannot listen on {addr} for /healthz, /readyz and /metrics: {source}. Is the port in use? Set --listen-addr"
    )]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Workers were still busy when the grace period ended.
    #[error(
        "shutdown grace period of {0:?} ran out with batches in flight; their rows will be claimed again"
    )]
    GraceExceeded(Duration),
    /// A setting is out of range.
    #[error("invalid configuration: {0}")]
    Config(String),
}

impl DispatcherError {
    /// Whether a statement failed because the schema lacks what it names (the schema may be
    /// behind this release: `crate::refusals::schema` tells).
    pub fn is_schema_mismatch(&self) -> bool {
        matches!(self, Self::Store(e) if e.is_schema_mismatch())
    }
}

impl outbox_runtime::exit::Failure for DispatcherError {
    /// Configuration: settings, the Pub/Sub client or its requests, the listen address, and the
    /// database errors retrying cannot fix. Run-time: an unreachable database, a store error, a
    /// shutdown that ran out of time.
    fn is_configuration(&self) -> bool {
        match self {
            Self::Config(_)
            | Self::PubsubClient { .. }
            | Self::PubsubRefused(_)
            | Self::Listen { .. } => true,
            Self::Connect(e) => e.is_configuration(),
            Self::Store(e) => e.is_configuration(),
            Self::GraceExceeded(_) => false,
        }
    }
}
