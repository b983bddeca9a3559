//! Why the console cannot run ([`ConsoleError`]) and which of its failures are the operator's
//! configuration (exit 2).

use std::net::SocketAddr;

/// Why the console cannot run.
#[derive(Debug, thiserror::Error)]
pub enum ConsoleError {
    /// The options contradict each other (exit 2).
    #[error("{0}")]
    Config(String),
    /// PostgreSQL cannot be reached, or DATABASE_URL is wrong.
    #[error(transparent)]
    Connect(#[from] outbox_runtime::db::ConnectError),
    /// The listen address is taken or not ours (exit 2).
    #[error("listening on {addr} failed: {source}; choose another --listen-addr")]
    Listen {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// Serving failed.
    #[error("serving the console failed: {0}")]
    Serve(#[source] std::io::Error),
}

impl outbox_runtime::exit::Failure for ConsoleError {
    fn is_configuration(&self) -> bool {
        match self {
            Self::Config(_) | Self::Listen { .. } => true,
            Self::Connect(e) => e.is_configuration(),
            Self::Serve(_) => false,
        }
    }
}
