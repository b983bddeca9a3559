//! pubsub-outbox dispatcher: turns committed `pubsub_outbox` rows into Pub/Sub messages.
//!
//! Layout, one folder per concern, the lower ones first (none imports a folder listed after it,
//! but the heartbeat task's staleness bound from `ops`):
//! - `pubsub/`: the Pub/Sub path, below everything that dispatches: the [`publish::Publish`]
//!   seam; [`publisher`]: it on Pub/Sub's transport (requests planned by `pubsub/plan.rs`, gRPC
//!   calls on tonic in [`transport`], protobuf in `wire.rs`, send spans in `trace.rs`);
//!   [`classify`]: publish failures as transient / permanent / topic refused / throttled / not
//!   attempted, one table of gRPC codes; [`fault`]: fault injection in front of a publisher.
//! - `refusals/`: what holds the dispatcher back, as state its workers share: held topics
//!   (`hold`), poison storms (`storm`), quota (`pace`), the circuit breaker (`breaker`), the
//!   schema gate (`schema`).
//! - `floors/`: where the claims start (what this replica knows is published) and their upkeep.
//! - `batch/`: one unit of work in three steps, `claim` → `send` (the first attempt, `isolate`:
//!   calls of their own for what Pub/Sub refused, the pure `decide`) → `outcome` (settle and
//!   commit); under them `dispatch`, the state the workers share, and `liveness`; over them
//!   `worker`, the loop.
//! - `tasks/`: the background tasks, a file each (endpoints, LISTEN, gauges, the held topics'
//!   probes, the replica heartbeat, the purge).
//! - [`ops`]: the operator's commands (status, dead letters, pause/resume, audit);
//!   [`console`]: the same in a browser (`dispatcher console`).
//! - Beside them, at the top: [`service`], the dispatcher as a value ([`Dispatcher`]: build, run
//!   one batch, run until stopped); [`cli`], the command line and environment that make a
//!   [`config`] ([`DispatcherConfig`]: the configuration as validated values, under everything
//!   like [`error`] and `log_gate.rs`, rate-limited warnings); [`metrics`], over `pubsub/` (the
//!   failure kinds name its series) and under everything else.
//!
//! All SQL lives in `outbox_shared::store`.

mod batch;
pub mod cli;
pub mod config;
pub mod console;
pub mod error;
mod floors;
mod log_gate;
pub mod metrics;
pub mod ops;
mod pubsub;
mod refusals;
pub mod service;
mod tasks;
#[cfg(test)]
mod test_support;

// The Pub/Sub path's public modules, at the paths the binary, the tests and the benchmarks use.
pub use pubsub::{classify, fault, publish, publisher, transport};

pub use batch::outcome::{BatchOutcome, Settled};
pub use classify::Code;
pub use cli::{Cli, Command};
pub use config::DispatcherConfig;
pub use error::DispatcherError;
pub use service::{Dispatcher, connect_database};
pub use tasks::hold_watch::Probe;
