//! All SQL of the inbox: the schema, recording a dedupe key, checking a transaction, retention.
//!
//! Functions take `&mut PgConnection` (a transaction derefs to one) so [`crate::Inbox`] decides
//! the transaction: the key is recorded in the same transaction as the handler's writes, so the
//! two commit or roll back together.

use std::time::Duration;

use outbox_shared::db::{MigrateSettings, apply};
use sqlx::{PgConnection, PgPool};

use crate::error::{DbContext, Result};

/// The schema steps, in order. Each runs once per database (recorded in
/// `pubsub_inbox_schema`) and is idempotent as well, so a database that got the table from
/// another tool is fine. A later change is a new file appended here.
const SCHEMA: &[(&str, &str)] = &[(
    "001_create_pubsub_inbox",
    include_str!("../migrations/001_create_pubsub_inbox.sql"),
)];

/// Applies the steps of [`SCHEMA`] not yet recorded, each in its own transaction with the
/// outbox's migration rules (a short lock timeout, retried with backoff while the application's
/// transactions hold the table, naming who blocks it: `outbox_shared::db::apply`), serialised
/// across processes by the run's lock. Its own bookkeeping table rather than sqlx's
/// `_sqlx_migrations`: a consumer's database usually belongs to an application with its own
/// migrations there, which would refuse to run beside versions they do not know.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn apply_schema(pool: &PgPool, settings: &MigrateSettings) -> Result<()> {
    let mut lock =
        apply::RunLock::take(&pool.connect_options(), "pubsub_inbox:schema", settings).await?;
    let applied = async {
        let mut conn = pool
            .acquire()
            .await
            .context("connecting to create the inbox table")?;
        apply_pending(&mut lock, &mut conn, settings).await
    }
    .await;
    lock.release().await;
    applied
}

async fn apply_pending(
    lock: &mut apply::RunLock,
    conn: &mut PgConnection,
    settings: &MigrateSettings,
) -> Result<()> {
    let mut tx = sqlx::Connection::begin(&mut *conn)
        .await
        .context("starting the inbox schema transaction")?;
    sqlx::raw_sql(&apply::timeouts("LOCAL", settings))
        .execute(&mut *tx)
        .await
        .context("setting the inbox schema's timeouts")?;
    sqlx::raw_sql(
        "CREATE TABLE IF NOT EXISTS pubsub_inbox_schema (
             step       text        PRIMARY KEY,
             applied_at timestamptz NOT NULL DEFAULT now())",
    )
    .execute(&mut *tx)
    .await
    .context("creating pubsub_inbox_schema (the role needs CREATE on the schema)")?;
    let applied: Vec<String> = sqlx::query_scalar("SELECT step FROM pubsub_inbox_schema")
        .fetch_all(&mut *tx)
        .await
        .context("reading pubsub_inbox_schema")?;
    tx.commit()
        .await
        .context("committing the inbox schema's bookkeeping")?;
    for (i, (step, sql)) in SCHEMA.iter().enumerate() {
        if applied.iter().any(|a| a == step) {
            continue;
        }
        let name: &'static str = step;
        apply::apply_step(
            lock,
            conn,
            settings,
            &apply::Step {
                version: i64::try_from(i + 1).unwrap_or(i64::MAX),
                description: step,
                sql,
                no_tx: sql.starts_with("-- no-transaction"),
            },
            &move |c, _| {
                Box::pin(async move {
                    sqlx::query("INSERT INTO pubsub_inbox_schema (step) VALUES ($1)")
                        .bind(name)
                        .execute(c)
                        .await
                        .map(|_| ())
                })
            },
        )
        .await?;
    }
    Ok(())
}

/// Records `dedupe_key` as processed by `consumer` in the caller's transaction. Returns `true`
/// when the key is new (run the handler), `false` when it was already committed (a duplicate).
///
/// If another transaction holds the same key uncommitted (a redelivery racing the first
/// delivery), the insert waits on the primary key until that transaction ends: after its
/// commit this is a duplicate, after its rollback this one records the key and goes on.
#[tracing::instrument(skip_all, fields(db.system = "postgresql", outbox.dedupe_key = dedupe_key), err(level = "debug"))]
pub async fn record(conn: &mut PgConnection, consumer: &str, dedupe_key: &str) -> Result<bool> {
    let inserted = sqlx::query(
        "INSERT INTO pubsub_inbox (consumer, dedupe_key) VALUES ($1, $2)
         ON CONFLICT (consumer, dedupe_key) DO NOTHING",
    )
    .bind(consumer)
    .bind(dedupe_key)
    .execute(&mut *conn)
    .await
    .context("recording the dedupe key in pubsub_inbox")?
    .rows_affected();
    Ok(inserted == 1)
}

/// Fails when the caller's transaction is aborted (a statement in it failed). PostgreSQL answers
/// `COMMIT` of an aborted transaction with a silent rollback, so without this check a handler
/// that swallowed an SQL error would get its message acked with nothing written.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn check_usable(conn: &mut PgConnection) -> std::result::Result<(), sqlx::Error> {
    sqlx::query("SELECT 1").execute(&mut *conn).await?;
    Ok(())
}

/// Deletes at most `batch` inbox rows processed more than `older_than` ago (oldest first, all
/// consumers) in one statement; returns how many. Rows a concurrent purge holds are skipped.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn purge_batch(conn: &mut PgConnection, older_than: Duration, batch: i64) -> Result<u64> {
    let deleted = sqlx::query(
        "WITH old AS MATERIALIZED (
             SELECT consumer, dedupe_key FROM pubsub_inbox
             WHERE processed_at < now() - make_interval(secs => $1)
             ORDER BY processed_at
             LIMIT $2
             FOR UPDATE SKIP LOCKED)
         DELETE FROM pubsub_inbox i USING old
         WHERE i.consumer = old.consumer AND i.dedupe_key = old.dedupe_key",
    )
    .bind(older_than.as_secs_f64())
    .bind(batch)
    .execute(&mut *conn)
    .await
    .context("purging old pubsub_inbox rows")?
    .rows_affected();
    Ok(deleted)
}
