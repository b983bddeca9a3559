//! The outbox contract: what an application needs to write to `pubsub_outbox` in its own
//! transaction, and what the producer and the dispatcher share about the table.
//!
//! It links no server, CLI or telemetry stack (those live in `outbox_runtime`, the service
//! runtime of the two binaries, in `shared/runtime/`): an application depends on this crate
//! alone. The names an application uses are re-exported at the root:
//!
//! ```no_run
//! # async fn example(pool: sqlx::PgPool) -> Result<(), outbox_shared::Error> {
//! use outbox_shared::{NewMessage, enqueue_batch, notify, DEFAULT_NOTIFY_CHANNEL};
//!
//! let mut tx = pool.begin().await.map_err(outbox_shared::Error::begin)?;
//! // ... the application's own writes on `tx` ...
//! let message = NewMessage::new("projects/p/topics/invoices", "invoice-1001-v3", b"{}".to_vec());
//! enqueue_batch(&mut tx, &[message]).await?;
//! notify(&mut tx, DEFAULT_NOTIFY_CHANNEL).await?;
//! tx.commit().await.map_err(outbox_shared::Error::commit)?;
//! # Ok(()) }
//! ```
//!
//! Layout:
//! - [`message`]: the message types that move through the outbox ([`NewMessage`], [`ClaimedMessage`]).
//! - [`limits`]: Pub/Sub's hard limits, checked locally before a message costs a round trip.
//! - [`retry`]: the durable retry schedule, a pure function of attempts and `now`.
//! - [`store`]: ALL SQL, one module per table. Functions take a connection or a transaction so
//!   callers compose transactions.
//! - [`db`]: the embedded migrations and their own bookkeeping table ([`MIGRATOR`], [`migrate`]),
//!   and whether a database's schema is the one this release runs on ([`schema_state`]).
//! - [`error`]: the typed errors of this crate.

pub mod db;
pub mod error;
pub mod limits;
pub mod message;
pub mod release;
pub mod retry;
pub mod store;
pub mod trace;

pub use db::{MIGRATOR, Migrated, SchemaState, migrate, schema_state};
pub use error::{Error, Result};
pub use limits::{LimitViolation, check_publishable};
pub use message::{Attributes, ClaimedMessage, NewMessage, TopicNameError, resolve_topic};
pub use retry::{RetryDecision, RetrySchedule};
pub use store::notify::{DEFAULT_CHANNEL as DEFAULT_NOTIFY_CHANNEL, notify};
pub use store::outbox::enqueue_batch;
pub use trace::{TraceContext, TraceParent};

/// The attribute that carries a message's dedupe key to consumers, unless configured otherwise.
pub const DEFAULT_DEDUPE_ATTRIBUTE: &str = "dedupe_key";
