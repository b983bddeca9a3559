//! The schema gate: a replica claims only on a schema that has every migration of its release.
//!
//! A rollout ahead of its migration (or a dispatcher pointed at an empty database) would
//! otherwise fail every statement, log an error per batch and per background task, and still
//! answer `/readyz` 200: every probe passes and nothing is delivered. Instead the gate reads the
//! schema's version (`outbox_shared::db::schema_state`) at start, again every
//! [`RECHECK_EVERY`] while it is closed, and whenever a batch fails because the schema lacks
//! what a statement names. While it is closed: `/readyz` answers 503 with what to run, nothing
//! is claimed, the background tasks that read the outbox's tables wait, and one ERROR line a
//! [`RECHECK_EVERY`] says why. It opens by itself once `migrate` ran. A schema *newer* than the
//! release is a rolling upgrade and is served (`outbox_shared::db::version`'s module doc).

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use outbox_runtime::shutdown::Shutdown;
use outbox_shared::db::{SchemaState, schema_state};
use sqlx::PgPool;
use tokio::sync::Notify;
use tokio::time::Instant;

/// How often a closed gate reads the schema's version again (and says why it is closed).
pub(crate) const RECHECK_EVERY: Duration = Duration::from_secs(10);

/// Whether the schema lets this replica claim; shared by its workers and background tasks.
#[derive(Debug, Default)]
pub(crate) struct SchemaGate {
    /// Why it is closed (`None`: open).
    behind: Mutex<Option<String>>,
    /// When the closed gate last logged why.
    logged_at: Mutex<Option<Instant>>,
    /// Said once: the schema is newer than this release.
    said_newer: AtomicBool,
    opened: Notify,
}

impl SchemaGate {
    /// Why claims wait (the schema is behind this release and what to run), if they do.
    pub(crate) fn behind(&self) -> Option<String> {
        self.behind.lock().ok().and_then(|b| b.clone())
    }

    /// Whether claims may proceed.
    pub(crate) fn is_open(&self) -> bool {
        self.behind().is_none()
    }

    /// Reads the schema's version and opens or closes the gate; returns whether it is open. A
    /// database that does not answer leaves the gate as it was (that is not the schema's fault;
    /// the caller's own statements report it).
    pub(crate) async fn check(&self, pool: &PgPool) -> bool {
        let state = async {
            let mut tx = pool.begin().await.map_err(outbox_shared::Error::begin)?;
            let state = schema_state(&mut tx).await;
            let _ = tx.rollback().await;
            state
        }
        .await;
        match state {
            Ok(SchemaState::Current { .. }) => self.open(),
            Ok(SchemaState::Newer { version, ours }) => {
                if !self.said_newer.swap(true, Ordering::Relaxed) {
                    tracing::info!(
                        schema = version,
                        release = ours,
                        "The schema is newer than this release (a rolling upgrade: a newer release migrated it). \
                         This release runs on it: the outbox's migrations only add."
                    );
                }
                self.open();
            }
            Ok(SchemaState::Behind(behind)) => self.close(behind.to_string()),
            Err(e) => {
                tracing::warn!(error = %e, "Reading the schema's version failed; it is read again later.")
            }
        }
        self.is_open()
    }

    fn open(&self) {
        let was = self.behind.lock().ok().and_then(|mut b| b.take());
        if was.is_some() {
            tracing::info!("The schema has every migration of this release now: claims start.");
            self.opened.notify_waiters();
        }
    }

    /// Closes with `reason`, logged at once when the gate was open, else at most once a
    /// [`RECHECK_EVERY`].
    fn close(&self, reason: String) {
        let Ok(mut behind) = self.behind.lock() else {
            return;
        };
        let Ok(mut logged_at) = self.logged_at.lock() else {
            return;
        };
        let due = behind.is_none() || logged_at.is_none_or(|t| t.elapsed() >= RECHECK_EVERY);
        if due {
            tracing::error!(
                reason = %reason,
                "The database schema is behind this release: {reason}. This replica is not ready \
                 and claims nothing until then."
            );
            *logged_at = Some(Instant::now());
        }
        *behind = Some(reason);
    }

    /// Returns when the gate is open, or when shutdown is requested; `beat` is called on every
    /// turn of the wait (the worker is alive, only held back).
    pub(crate) async fn admit(&self, shutdown: &mut Shutdown, beat: impl Fn()) {
        loop {
            beat();
            let opened = self.opened.notified();
            if self.is_open() {
                return;
            }
            tokio::select! {
                _ = opened => {}
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                _ = shutdown.requested() => return,
            }
        }
    }
}

/// Reads the schema's version again every [`RECHECK_EVERY`] while the gate is closed, until
/// shutdown.
pub(crate) async fn watch(gate: std::sync::Arc<SchemaGate>, pool: PgPool, mut shutdown: Shutdown) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(RECHECK_EVERY) => {}
            _ = shutdown.requested() => return,
        }
        if !gate.is_open() {
            gate.check(&pool).await;
        }
    }
}
