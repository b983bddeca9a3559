//! The console's shared state ([`Console`]): its pool, how it knows who asks, the CSRF key,
//! the samples of the last hour and the last `status`. The overview renders that `status`,
//! read once per interval in the background ([`refresh_status`], spawned by `server.rs`), so a
//! page costs no query however large the outbox and however many browsers watch; after a
//! change it is forgotten and read again.

use std::sync::Arc;
use std::time::Duration;

use outbox_runtime::shutdown::Shutdown;
use sqlx::PgPool;

use super::args::{AuthMode, ConsoleArgs};
use super::{auth, csrf, samples};

/// The console's shared state.
#[derive(Debug)]
pub struct Console {
    pub(super) pool: PgPool,
    pub(super) auth: auth::Auth,
    pub(super) csrf: csrf::Csrf,
    pub(super) samples: Arc<samples::Samples>,
    /// The last `status` and when it was read: the overview renders it, so a page costs no
    /// query however large the outbox, and status runs once per interval however many
    /// browsers watch.
    status: std::sync::Mutex<Option<(std::time::Instant, serde_json::Value)>>,
    /// How long the last `status` read took (its next one waits at least 10 times that).
    status_took: std::sync::Mutex<Duration>,
    interval: Duration,
    pub(super) actions: bool,
    pub(super) skip_dead_letter_topics: Vec<String>,
}

impl Console {
    /// The console for `args` on `pool`.
    pub fn new(args: &ConsoleArgs, pool: PgPool) -> Self {
        let auth = match args.auth {
            AuthMode::Local => auth::Auth::Local {
                user: outbox_runtime::operator::actor(args.local_user.as_deref())
                    .unwrap_or_else(|| "local operator".to_owned()),
            },
            AuthMode::Iap => auth::Auth::Iap(auth::Iap::new(
                args.iap_audience.clone().unwrap_or_default(),
                args.iap_keys_url.clone(),
            )),
        };
        Self {
            pool,
            auth,
            csrf: csrf::Csrf::new(args.csrf_key.as_deref()),
            samples: Arc::new(samples::Samples::default()),
            status: std::sync::Mutex::new(None),
            status_took: std::sync::Mutex::new(Duration::ZERO),
            interval: args.sample_interval,
            actions: args.actions,
            skip_dead_letter_topics: args.skip_dead_letters.topics.clone(),
        }
    }

    /// `status` (with the console's skip flags) as of at most one interval ago, and its age:
    /// the last one read, else read now.
    pub(super) async fn status(&self) -> Result<(serde_json::Value, Duration), String> {
        let cached = self.status.lock().ok().and_then(|s| s.clone());
        match cached {
            Some((at, json)) if at.elapsed() <= self.status_every() * 2 => Ok((json, at.elapsed())),
            _ => self
                .refresh_status()
                .await
                .map(|json| (json, Duration::ZERO)),
        }
    }

    /// Reads `status` now and keeps it for the overview.
    async fn refresh_status(&self) -> Result<serde_json::Value, String> {
        let mut args = vec!["status".to_owned()];
        args.extend(self.skip_flags());
        let started = std::time::Instant::now();
        let json = self.json(&args).await?;
        if let Ok(mut took) = self.status_took.lock() {
            *took = started.elapsed();
        }
        if let Ok(mut s) = self.status.lock() {
            *s = Some((std::time::Instant::now(), json.clone()));
        }
        Ok(json)
    }

    /// How often `status` is read: every interval, or 10 times its own last duration when that
    /// is longer (a huge backlog: the read stays under a tenth of one connection's time).
    pub(super) fn status_every(&self) -> Duration {
        let took = self.status_took.lock().map_or(Duration::ZERO, |t| *t);
        self.interval.max(took * 10)
    }

    /// After a change: the next overview reads `status` again.
    pub(super) fn forget_status(&self) {
        if let Ok(mut s) = self.status.lock() {
            *s = None;
        }
    }

    /// Messages waiting behind a dead letter of `topic`'s `key` at `outbox_id`.
    pub(super) async fn held_behind(
        &self,
        topic: &str,
        key: &str,
        outbox_id: Option<i64>,
    ) -> Result<i64, outbox_shared::Error> {
        let mut conn =
            self.pool
                .begin()
                .await
                .map_err(|source| outbox_shared::Error::Database {
                    context: "reading what a dead letter holds back",
                    source,
                })?;
        let n =
            outbox_shared::store::dead_letter::held_behind(&mut conn, topic, key, outbox_id).await;
        let _ = conn.rollback().await;
        n
    }
}

/// Reads `status` for the overview every interval (or 10 times its duration) until shutdown (a failure is logged; the
/// overview then reads it itself).
pub(super) async fn refresh_status(console: Arc<Console>, mut shutdown: Shutdown) {
    loop {
        if let Err(e) = console.refresh_status().await {
            tracing::warn!(error = %e, "The console could not read the status; the overview will try again.");
        }
        let every = console.status_every();
        tokio::select! { _ = tokio::time::sleep(every) => {}, _ = shutdown.requested() => return }
    }
}
