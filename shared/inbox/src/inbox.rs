//! [`Inbox::process`]: one received message, one transaction, the handler at most once per key.
//!
//! The sequence, and why each step is where it is:
//! 1. `BEGIN`;
//! 2. record `(consumer, dedupe_key)` with `ON CONFLICT DO NOTHING`: a conflict means the key
//!    already committed, so the message is a duplicate: roll back, report [`Outcome::Duplicate`]
//!    (ack it) without running the handler;
//! 3. run the handler on the same transaction; an error rolls everything back (the key too) and
//!    reports [`Outcome::Failed`] (nack it: the message is redelivered and processed then);
//! 4. check the transaction is not aborted, `COMMIT`, and only then report
//!    [`Outcome::Processed`] (ack it).
//!
//! A crash anywhere before the commit loses nothing (no ack was sent, Pub/Sub redelivers); a
//! crash after the commit and before the ack makes the redelivery a duplicate. So the handler's
//! effects happen exactly once per key, whatever is redelivered or re-published.

use std::sync::Arc;
use std::time::Duration;

use outbox_shared::db::MigrateSettings;
use sqlx::{PgConnection, PgPool};

use crate::counters::{Counters, InboxCounters};
use crate::error::{DbContext, Error, Result};
use crate::store;

/// What happened to one message. Ack on [`Outcome::Processed`] and [`Outcome::Duplicate`]
/// ([`Outcome::should_ack`]); nack on [`Outcome::Failed`].
#[derive(Debug)]
#[must_use = "ack the message on Processed/Duplicate and nack it on Failed"]
pub enum Outcome<E> {
    /// The key was new; the handler ran and its writes committed with the key.
    Processed,
    /// The key had already committed: the handler did not run, nothing was written.
    Duplicate,
    /// Nothing was committed; the message must be redelivered.
    Failed(Failure<E>),
}

impl<E> Outcome<E> {
    /// Whether the message may be acked now (it was committed, by this call or an earlier one).
    pub fn should_ack(&self) -> bool {
        !matches!(self, Outcome::Failed(_))
    }
}

/// Why a message failed. In every case the transaction rolled back and nothing was written.
#[derive(Debug, thiserror::Error)]
pub enum Failure<E> {
    /// The handler returned an error.
    #[error("the handler failed: {0}")]
    Handler(E),
    /// The inbox could not record or commit (database unreachable, missing dedupe key, ...).
    #[error(transparent)]
    Inbox(#[from] Error),
}

/// The inbox of one consumer database. Cheap to clone (a pool and shared counters).
#[derive(Debug, Clone)]
pub struct Inbox {
    pool: PgPool,
    counters: Arc<Counters>,
}

impl Inbox {
    /// An inbox on `pool` (its database must have the schema: [`crate::migrate`]).
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            counters: Arc::default(),
        }
    }

    /// The pool the inbox opens its transactions on.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Processes the message with `dedupe_key` for `consumer` (the subscription's name, say):
    /// runs `handler` on the transaction that records the key, only if the key is new. See the
    /// module documentation for the sequence. Never acks anything itself: the caller acks on
    /// [`Outcome::should_ack`], which is only true once the key is committed.
    ///
    /// The handler must do all its writes on the connection it is given and return its SQL
    /// errors; writes elsewhere (another pool, an HTTP call) are not covered by the guarantee.
    #[tracing::instrument(skip_all, fields(inbox.consumer = consumer, outbox.dedupe_key = dedupe_key))]
    pub async fn process<E>(
        &self,
        consumer: &str,
        dedupe_key: &str,
        handler: impl AsyncFnOnce(&mut PgConnection) -> Result<(), E>,
    ) -> Outcome<E> {
        let outcome = self.process_inner(consumer, dedupe_key, handler).await;
        match &outcome {
            Outcome::Processed => self.counters.processed(),
            Outcome::Duplicate => {
                self.counters.duplicate();
                tracing::debug!("duplicate dropped");
            }
            Outcome::Failed(_) => self.counters.failure(),
        }
        outcome
    }

    async fn process_inner<E>(
        &self,
        consumer: &str,
        dedupe_key: &str,
        handler: impl AsyncFnOnce(&mut PgConnection) -> Result<(), E>,
    ) -> Outcome<E> {
        let failed = |e: Error| Outcome::Failed(Failure::Inbox(e));
        if dedupe_key.is_empty() {
            return failed(Error::MissingDedupeKey {
                attribute: outbox_shared::DEFAULT_DEDUPE_ATTRIBUTE.to_owned(),
            });
        }
        let mut tx = match self
            .pool
            .begin()
            .await
            .context("starting the inbox transaction")
        {
            Ok(tx) => tx,
            Err(e) => return failed(e),
        };
        match store::record(&mut tx, consumer, dedupe_key).await {
            Ok(true) => {}
            Ok(false) => {
                // Nothing was written; a failed rollback only closes the connection.
                let _ = tx.rollback().await;
                return Outcome::Duplicate;
            }
            Err(e) => return failed(e),
        }
        if let Err(e) = handler(&mut tx).await {
            // Dropping the transaction would roll back too; doing it here returns a clean
            // connection to the pool at once.
            let _ = tx.rollback().await;
            return Outcome::Failed(Failure::Handler(e));
        }
        if let Err(source) = store::check_usable(&mut tx).await {
            let _ = tx.rollback().await;
            return failed(Error::AbortedTransaction { source });
        }
        // A commit error is ambiguous (the commit may have reached the server): failing is
        // safe either way, the redelivery is then processed or dropped as a duplicate.
        match tx
            .commit()
            .await
            .context("committing the handler's transaction")
        {
            Ok(()) => Outcome::Processed,
            Err(e) => failed(e),
        }
    }

    /// Deletes inbox rows processed more than `retention` ago, `batch_size` rows per statement
    /// (each its own short transaction, so no long lock or snapshot), until none is left.
    /// Returns how many were deleted.
    ///
    /// `retention` must exceed the longest time a duplicate can still arrive: the subscription's
    /// message retention (7 days by default) plus any delay before the outbox re-publishes. A
    /// duplicate arriving after its row is purged is processed again.
    #[tracing::instrument(skip_all, err(level = "debug"))]
    pub async fn purge(&self, retention: Duration, batch_size: u32) -> Result<u64> {
        let batch = i64::from(batch_size.max(1));
        let mut total = 0;
        loop {
            let mut conn = self
                .pool
                .acquire()
                .await
                .context("connecting to purge pubsub_inbox")?;
            let n = store::purge_batch(&mut conn, retention, batch).await?;
            self.counters.purged(n);
            total += n;
            if n < batch as u64 {
                return Ok(total);
            }
        }
    }

    /// Counts a message that failed before reaching [`Inbox::process`] (no dedupe key).
    #[cfg_attr(not(feature = "pubsub"), allow(dead_code))]
    pub(crate) fn count_failure(&self) {
        self.counters.failure();
    }

    /// The counters so far (processed, duplicates dropped, failures, purged).
    pub fn counters(&self) -> InboxCounters {
        self.counters.snapshot()
    }
}

/// Creates the inbox table if needed (idempotent, safe from many processes at once), with the
/// default [`MigrateSettings`].
pub async fn migrate(pool: &PgPool) -> Result<()> {
    migrate_with(pool, &MigrateSettings::default()).await
}

/// [`migrate`] with the lock timeout, statement timeout and deadline of `settings`: the rules of
/// the outbox's own migrations (docs/migrations.md).
pub async fn migrate_with(pool: &PgPool, settings: &MigrateSettings) -> Result<()> {
    store::apply_schema(pool, settings).await
}
