//! pubsub-outbox dispatcher: turns committed `pubsub_outbox` rows into Pub/Sub messages.
//!
//! Layout:
//! - [`config`]: the configuration as validated values ([`DispatcherConfig`]); [`cli`]: the
//!   command line and environment that make one.
//! - [`service`]: the dispatcher as a value ([`Dispatcher`]: build, run one batch, run until
//!   stopped); `tasks`: its background tasks (LISTEN, gauges, purge, endpoints).
//! - `batch`: one unit of work (claim, check, publish, isolate, decide, settle in one
//!   transaction); `decide`: its decisions as pure functions; `dispatch`: the state the workers
//!   share; `worker`: the worker loop; `liveness`: the worker heartbeats behind `/healthz`; `floors`:
//!   where the claims start (what this replica knows is published); `storm`: a topic whose
//!   messages Pub/Sub keeps refusing sends its unkeyed rows in parts.
//! - [`publisher`]: the [`publisher::Publish`] seam, and batches as Pub/Sub requests;
//!   [`transport`]: the gRPC calls on tonic (connections, credentials, headers); `wire`: the
//!   requests' protobuf encoding.
//! - [`classify`]: publish failures as transient / permanent / topic refused / throttled / not
//!   attempted, one table of gRPC codes; `hold`: a topic Pub/Sub refuses as a whole is held and
//!   probed, never dead-lettered; `pace`: quota slows a topic down, charging no attempt.
//! - [`breaker`]: pauses claiming while Pub/Sub is unreachable; `schema`: while the schema is
//!   behind this release.
//! - [`fault`]: fault injection in front of the publisher (`--inject-failure-rate`, tests).
//! - [`ops`]: the operator's commands (status, dead letters, pause/resume, audit);
//!   [`console`]: the same in a browser (`dispatcher console`).
//! - [`metrics`], [`error`].
//!
//! All SQL lives in `outbox_shared::store`.

mod batch;
pub mod breaker;
pub mod classify;
pub mod cli;
pub mod config;
pub mod console;
mod decide;
mod dispatch;
pub mod error;
pub mod fault;
mod floors;
pub mod hold;
mod liveness;
mod log_gate;
pub mod metrics;
pub mod ops;
mod pace;
pub mod publisher;
mod schema;
pub mod service;
mod storm;
mod tasks;
#[cfg(test)]
mod test_support;
mod trace;
pub mod transport;
mod wire;
mod worker;

pub use batch::{BatchOutcome, Settled};
pub use classify::Code;
pub use cli::{Cli, Command};
pub use config::DispatcherConfig;
pub use error::DispatcherError;
pub use hold::Probe;
pub use service::{Dispatcher, connect_database};
