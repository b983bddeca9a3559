//! One unit of work, [`run_batch`]: a batch of rows claimed, sent and settled in one PostgreSQL
//! transaction, in three steps, each a module of its own:
//!
//! 1. `crate::claim`: a claim transaction locks whole ordering keys, then unkeyed rows
//!    (`FOR UPDATE SKIP LOCKED`), from where this replica knows the live rows start;
//! 2. `crate::send`: the local checks, the first attempt (cut into requests by `crate::parts`),
//!    isolation of what Pub/Sub refused, and the decision of each row's fate (`crate::decide`,
//!    pure);
//! 3. `crate::outcome`: the settlement written and committed in the claim's transaction, then
//!    the metrics, logs and the batch's outcome.
//!
//! A crash anywhere before the commit rolls everything back (the rows are claimed again;
//! published ones are re-sent: at-least-once).

use std::time::Instant;

use chrono::{DateTime, Utc};

use crate::claim::{self, Scope};
use crate::dispatch::Dispatch;
use crate::error::DispatcherError;
use crate::outcome::{self, BatchOutcome, Timing};
use crate::publish::Publish;
use crate::send;

/// Claims, publishes and settles one batch of rows due at `now`. With tracing on, the batch is a
/// span (`run_batch`) with the steps `claim`, `publish` and `settle` as its children; retries,
/// dead letters and an outage are its events and status (docs/tracing.md).
pub(crate) async fn run_batch<P: Publish>(
    d: &Dispatch<P>,
    now: DateTime<Utc>,
) -> Result<BatchOutcome, DispatcherError> {
    run(d, now, Scope::Serve).await
}

/// Probes the held `topic` with its head message: a batch of one that, accepted, releases the
/// topic (`crate::hold`). [`BatchOutcome::Empty`] when none of its rows is due.
pub(crate) async fn probe_held<P: Publish>(
    d: &Dispatch<P>,
    topic: &str,
    now: DateTime<Utc>,
) -> Result<BatchOutcome, DispatcherError> {
    run(d, now, Scope::Probe(topic)).await
}

#[tracing::instrument(
    name = "run_batch",
    skip_all,
    fields(
        batch.size = tracing::field::Empty,
        otel.status_code = tracing::field::Empty,
        otel.status_message = tracing::field::Empty,
    ),
    err(level = "debug")
)]
async fn run<P: Publish>(
    d: &Dispatch<P>,
    now: DateTime<Utc>,
    scope: Scope<'_>,
) -> Result<BatchOutcome, DispatcherError> {
    let started = Instant::now();
    let Some(mut claimed) = claim::claim(d, now, scope).await? else {
        return Ok(BatchOutcome::Empty);
    };
    let claimed_at = Instant::now();
    let sent = send::send(d, &mut claimed.messages, now, scope).await;
    let timing = Timing {
        started,
        claimed: claimed_at,
        sent: Instant::now(),
    };
    outcome::finish(d, claimed, sent, now, timing).await
}
