//! pubsub-outbox dispatcher: turns committed `pubsub_outbox` rows into Pub/Sub messages.
//!
//! Layout:
//! - [`config`]: the configuration as validated values ([`DispatcherConfig`]); [`cli`]: the
//!   command line and environment that make one.
//! - [`service`]: the dispatcher as a value ([`Dispatcher`]: build, run one batch, run until
//!   stopped); `tasks`: its background tasks (LISTEN, gauges, purge, endpoints).
//! - `batch`: one unit of work, three steps: `claim` (a claim transaction locks keys, then
//!   unkeyed rows), `send` (local checks, the first attempt, isolation, the decision; deciding is
//!   the pure `decide`), `outcome` (settle and commit, metrics and logs); `parts`: how a batch is
//!   cut into requests and into calls of their own (isolation, storms); `storm`: which topics are
//!   in a poison storm; `dispatch`: the state the workers share; `worker`: the worker loop;
//!   `liveness`: the worker heartbeats behind `/healthz`; `floors`: where the claims start (what
//!   this replica knows is published) and their upkeep.
//! - [`publish`]: the [`publish::Publish`] seam; [`publisher`]: it on Pub/Sub's transport;
//!   [`transport`]: the gRPC calls on tonic (connections, credentials, headers); `wire`: the
//!   requests' protobuf encoding.
//! - [`classify`]: publish failures as transient / permanent / topic refused / throttled / not
//!   attempted, one table of gRPC codes; `hold`: a topic Pub/Sub refuses as a whole is held,
//!   never dead-lettered, and `hold_watch` probes it; `pace`: quota slows a topic down, charging no attempt.
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
mod claim;
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
mod hold_watch;
mod liveness;
mod log_gate;
pub mod metrics;
pub mod ops;
mod outcome;
mod pace;
mod parts;
pub mod publish;
pub mod publisher;
mod schema;
mod send;
pub mod service;
mod storm;
mod tasks;
#[cfg(test)]
mod test_support;
mod trace;
pub mod transport;
mod wire;
mod worker;

pub use classify::Code;
pub use cli::{Cli, Command};
pub use config::DispatcherConfig;
pub use error::DispatcherError;
pub use hold_watch::Probe;
pub use outcome::{BatchOutcome, Settled};
pub use service::{Dispatcher, connect_database};
