//! The outbox contract shared by the producer and the dispatcher.
//!
//! Layout:
//! - [`message`]: the message types that move through the outbox ([`NewMessage`], [`ClaimedMessage`]).
//! - [`limits`]: Pub/Sub's hard limits, checked locally before a message costs a round trip.
//! - [`retry`]: the durable retry schedule, a pure function of attempts and `now`.
//! - [`store`]: ALL SQL, one module per table. Functions take a connection or a transaction so
//!   callers compose transactions (any application can enqueue with [`store::outbox::enqueue_batch`]).
//! - [`db`]: connecting (with bounded retries) and the embedded migrations.
//! - [`telemetry`], [`health`], [`shutdown`]: logging, the HTTP endpoints, and signal handling.
//! - [`error`]: the typed errors of this crate.

pub mod db;
pub mod error;
pub mod health;
pub mod limits;
pub mod message;
pub mod retry;
pub mod shutdown;
pub mod store;
pub mod telemetry;

pub use error::{Error, Result};
pub use message::{Attributes, ClaimedMessage, NewMessage};
