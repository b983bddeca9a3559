//! pubsub-outbox dispatcher: turns committed `pubsub_outbox` rows into Pub/Sub messages.
//!
//! Layout:
//! - [`cli`]: configuration (clap + env).
//! - [`service`]: the long-running service: workers, LISTEN, gauges, purge, HTTP endpoints.
//! - [`worker`]: one unit of work ([`worker::run_batch`]: claim, publish, settle in one
//!   transaction) and the worker loop.
//! - [`publisher`]: the [`publisher::Publish`] seam and the official Pub/Sub client behind it.
//! - [`classify`]: publish failures as transient / permanent / not attempted.
//! - [`breaker`]: pauses claiming while Pub/Sub is unreachable.
//! - [`chaos`]: fault injection in front of the publisher (chaos tests, `--chaos-failure-rate`).
//! - [`metrics`], [`error`].
//!
//! All SQL lives in `outbox_shared::store`.

pub mod breaker;
pub mod chaos;
pub mod classify;
pub mod cli;
pub mod error;
pub mod metrics;
pub mod publisher;
pub mod service;
pub mod worker;

pub use cli::{Cli, Command};
pub use error::DispatcherError;
