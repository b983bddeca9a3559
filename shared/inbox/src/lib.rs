//! The consumer side of the outbox: **effectively-once processing** with a PostgreSQL inbox.
//!
//! Delivery from the outbox is at-least-once, and a re-published message gets a new Pub/Sub
//! message id, so only its stable `dedupe_key` attribute identifies it. [`Inbox::process`] records
//! that key in `pubsub_inbox` in the same transaction as the handler's writes, runs the handler
//! only for a new key, commits, and only then says "ack"; a duplicate is acked without running the
//! handler, a handler error rolls back and says "nack". The handler's effects therefore happen
//! exactly once per key, through crashes, redeliveries and re-publishes.
//!
//! ```no_run
//! # async fn example(pool: sqlx::PgPool, dedupe_key: &str) -> Result<(), outbox_inbox::Error> {
//! use outbox_inbox::{Inbox, Outcome};
//!
//! outbox_inbox::migrate(&pool).await?;
//! let inbox = Inbox::new(pool);
//! let outcome = inbox
//!     .process("billing", dedupe_key, async |tx: &mut sqlx::PgConnection| {
//!         sqlx::query("UPDATE account SET balance = balance + 10 WHERE id = 1")
//!             .execute(&mut *tx)
//!             .await?;
//!         Ok::<_, sqlx::Error>(())
//!     })
//!     .await;
//! if outcome.should_ack() { /* ack */ } else { /* nack: it is redelivered */ }
//! # Ok(()) }
//! ```
//!
//! Layout:
//! - [`inbox`]: [`Inbox`] ([`Inbox::process`], retention [`Inbox::purge`], counters),
//!   [`Outcome`], [`Failure`], [`migrate`].
//! - [`store`]: ALL SQL of the inbox (schema, record, retention).
//! - `pubsub` (feature `pubsub`): the official `google-cloud-pubsub` subscriber glue and a
//!   consumer loop that keeps per-key order.
//! - [`error`]: the typed errors.
//!
//! It depends on the lean outbox contract (`outbox_shared`) and sqlx only, not on the
//! dispatcher; the schema has its own bookkeeping ([`migrate`]), because a consumer's database
//! is usually not the outbox's.

mod counters;
pub mod error;
pub mod inbox;
#[cfg(feature = "pubsub")]
pub mod pubsub;
pub mod store;

pub use counters::InboxCounters;
pub use error::{Error, Result};
pub use inbox::{Failure, Inbox, Outcome, migrate, migrate_with};
pub use outbox_shared::db::MigrateSettings;
