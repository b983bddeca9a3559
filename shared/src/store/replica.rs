//! `pubsub_outbox_replica`: one heartbeat row per running dispatcher process, so operators (and
//! `status`) can see which replicas are alive, their breaker and what they hold in flight. Row
//! locks are invisible to other connections; this table is the cheap, explicit substitute.

use chrono::{DateTime, Utc};
use sqlx::PgConnection;

use crate::error::{DbContext, Result};

/// What a replica reports about itself.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow, serde::Serialize)]
pub struct Replica {
    /// Unique per process (host, pid, start time).
    pub replica_id: String,
    /// The host (the pod name on GKE).
    pub hostname: String,
    /// The process id.
    pub pid: i32,
    /// The dispatcher's release (its version: `0.2.0`).
    pub version: String,
    /// The commit it was built from (`None`: a release before 0.2.0, which does not say).
    pub build_commit: Option<String>,
    /// The topics it serves (None: all).
    pub topics: Option<Vec<String>>,
    /// When it started.
    pub started_at: DateTime<Utc>,
    /// Its last heartbeat.
    pub heartbeat_at: DateTime<Utc>,
    /// Whether its circuit breaker is open (Pub/Sub unreachable from it).
    pub breaker_open: bool,
    /// Why it is open: the last probe's or publish's error, naming the endpoint.
    pub breaker_reason: Option<String>,
    /// Batches it holds (claimed, not yet settled).
    pub batches_in_flight: i32,
    /// Rows in those batches.
    pub rows_in_flight: i32,
    /// Messages it published since it started.
    pub published: i64,
}

/// Writes (or refreshes) `r`'s row, stamping the heartbeat with the server's clock.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn heartbeat(conn: &mut PgConnection, r: &Replica) -> Result<()> {
    sqlx::query(
        "INSERT INTO pubsub_outbox_replica (replica_id, hostname, pid, version, topics, started_at,
                                            heartbeat_at, breaker_open, breaker_reason, batches_in_flight,
                                            rows_in_flight, published, build_commit)
         VALUES ($1, $2, $3, $4, $5, $6, now(), $7, $8, $9, $10, $11, $12)
         ON CONFLICT (replica_id) DO UPDATE SET heartbeat_at = now(),
             breaker_open = EXCLUDED.breaker_open, breaker_reason = EXCLUDED.breaker_reason,
             batches_in_flight = EXCLUDED.batches_in_flight,
             rows_in_flight = EXCLUDED.rows_in_flight, published = EXCLUDED.published",
    )
    .persistent(crate::store::named_statements())
    .bind(&r.replica_id)
    .bind(&r.hostname)
    .bind(r.pid)
    .bind(&r.version)
    .bind(&r.topics)
    .bind(r.started_at)
    .bind(r.breaker_open)
    .bind(&r.breaker_reason)
    .bind(r.batches_in_flight)
    .bind(r.rows_in_flight)
    .bind(r.published)
    .bind(&r.build_commit)
    .execute(&mut *conn)
    .await
    .context("writing the replica heartbeat in pubsub_outbox_replica")?;
    Ok(())
}

/// Removes a replica's own row (a clean shutdown). Rows of replicas gone without one are
/// deleted by every heartbeat ([`prune`]).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn remove(conn: &mut PgConnection, replica_id: &str) -> Result<()> {
    sqlx::query("DELETE FROM pubsub_outbox_replica WHERE replica_id = $1")
        .persistent(crate::store::named_statements())
        .bind(replica_id)
        .execute(&mut *conn)
        .await
        .context("removing a replica from pubsub_outbox_replica")?;
    Ok(())
}

/// Deletes the rows of replicas whose heartbeat is older than `gone_for_secs` (only those of
/// `ids` when given); returns the ids deleted. A live replica is never among them: it sends a
/// heartbeat every 5 s (and would write its row again at the next one).
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn prune(
    conn: &mut PgConnection,
    gone_for_secs: f64,
    ids: Option<&[String]>,
) -> Result<Vec<String>> {
    sqlx::query_scalar(
        "DELETE FROM pubsub_outbox_replica
         WHERE heartbeat_at < now() - make_interval(secs => $1)
           AND ($2::text[] IS NULL OR replica_id = ANY($2))
         RETURNING replica_id",
    )
    .persistent(crate::store::named_statements())
    .bind(gone_for_secs)
    .bind(ids)
    .fetch_all(&mut *conn)
    .await
    .context("pruning gone replicas from pubsub_outbox_replica")
}

/// Every replica row, newest heartbeat first, with the server's `now()` to judge staleness by.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn list(conn: &mut PgConnection) -> Result<(DateTime<Utc>, Vec<Replica>)> {
    let now: DateTime<Utc> = sqlx::query_scalar("SELECT now()")
        .persistent(crate::store::named_statements())
        .fetch_one(&mut *conn)
        .await
        .context("reading the server clock")?;
    let replicas = sqlx::query_as(
        "SELECT replica_id, hostname, pid, version, topics, started_at, heartbeat_at, breaker_open,
                breaker_reason, batches_in_flight, rows_in_flight, published, build_commit
         FROM pubsub_outbox_replica ORDER BY heartbeat_at DESC",
    )
    .persistent(crate::store::named_statements())
    .fetch_all(&mut *conn)
    .await
    .context("listing pubsub_outbox_replica")?;
    Ok((now, replicas))
}

/// The replicas with a heartbeat within `within`, by the release they run (newest first).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, sqlx::FromRow)]
pub struct LiveRelease {
    /// The release (the heartbeat's `version`).
    pub version: String,
    /// How many replicas run it.
    pub replicas: i64,
    /// Their ids.
    pub replica_ids: Vec<String>,
}

/// The live replicas by release: what `status`, the console, the `outbox_replicas` metric and a
/// change an older release would misread ([`crate::release::Feature`]) go by.
#[tracing::instrument(skip_all, fields(db.system = "postgresql"), err(level = "debug"))]
pub async fn live_releases(
    conn: &mut PgConnection,
    within: std::time::Duration,
) -> Result<Vec<LiveRelease>> {
    let mut live: Vec<LiveRelease> = sqlx::query_as(
        "SELECT version, count(*)::bigint AS replicas,
                array_agg(replica_id ORDER BY replica_id) AS replica_ids
         FROM pubsub_outbox_replica
         WHERE heartbeat_at > now() - make_interval(secs => $1)
         GROUP BY version",
    )
    .persistent(crate::store::named_statements())
    .bind(within.as_secs_f64())
    .fetch_all(&mut *conn)
    .await
    .context("reading the live replicas' releases from pubsub_outbox_replica")?;
    live.sort_by(|a, b| {
        let (ra, rb) = (
            crate::release::Release::parse(&a.version),
            crate::release::Release::parse(&b.version),
        );
        rb.cmp(&ra).then_with(|| a.version.cmp(&b.version))
    });
    Ok(live)
}
