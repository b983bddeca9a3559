//! The batch and the workers that run it: one unit of work, [`run_batch`], a batch of rows
//! claimed, sent and settled in one PostgreSQL transaction, in three steps, each a module of its
//! own:
//!
//! 1. [`claim`]: a claim transaction locks whole ordering keys, then unkeyed rows
//!    (`FOR UPDATE SKIP LOCKED`), from where this replica knows the live rows start;
//! 2. [`send`]: the local checks, the first attempt (cut into requests by `crate::pubsub::plan`),
//!    isolation of what Pub/Sub refused ([`isolate`]: calls of their own), and the decision of
//!    each row's fate ([`decide`], pure; its table tests are `decide_tests.rs`);
//! 3. [`outcome`]: the settlement written and committed in the claim's transaction, then the
//!    metrics, logs and the batch's outcome.
//!
//! Under them, [`dispatch`]: the state the workers of a process share (the pool, the publisher,
//! the refusals' memory, the byte budget, the key walk) and [`liveness`]: their heartbeats. Over
//! them, [`worker`]: the loop that runs batches until shutdown.
//!
//! Invariants: a crash anywhere before the commit rolls everything back (the rows are claimed
//! again; published ones are re-sent: at-least-once); nothing is written between the claim and
//! the settlement (sending and deciding write no row); on an ordering key nothing goes out past a
//! message that was not published (`decide`'s module doc).

pub(crate) mod claim;
pub(crate) mod decide;
pub(crate) mod dispatch;
pub(crate) mod isolate;
pub(crate) mod liveness;
pub(crate) mod outcome;
pub(crate) mod send;
pub(crate) mod worker;

use std::time::Instant;

use chrono::{DateTime, Utc};

use crate::batch::claim::Scope;
use crate::batch::dispatch::Dispatch;
use crate::batch::outcome::{BatchOutcome, Timing};
use crate::error::DispatcherError;
use crate::pubsub::publish::Publish;

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
/// topic (`crate::refusals::hold`). [`BatchOutcome::Empty`] when none of its rows is due.
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
        probe: matches!(scope, Scope::Probe(_)),
    };
    outcome::finish(d, claimed, sent, now, timing).await
}
