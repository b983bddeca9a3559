//! The service runtime the producer and the dispatcher share, kept out of the outbox contract
//! (`outbox_shared`) so that an application that only enqueues links none of it.
//!
//! Layout:
//! - [`cli`]: `run` as both binaries' default command ([`cli::run_first`]).
//! - [`db`]: the `--database-url` argument group and connecting with bounded retries.
//! - [`telemetry`]: logging (text for people, JSON for Cloud Logging).
//! - [`health`]: the `/healthz`, `/readyz` and `/metrics` server.
//! - [`shutdown`]: shutdown as a value, fired by signals.
//! - [`table`]: the operator commands' human tables.
//! - [`exit`]: the binaries' one rule for exit codes and for printing a failure once.
//! - [`operator`]: the one design of both binaries' operator commands (options, checks, the
//!   actor, errors and exit codes, output as a table or JSON).

pub mod cli;
pub mod db;
pub mod exit;
pub mod health;
pub mod operator;
pub mod release;
pub mod shutdown;
pub mod table;
pub mod telemetry;
pub mod traces;
