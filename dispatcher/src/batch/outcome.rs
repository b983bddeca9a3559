//! The batch's last step: settling what [`crate::batch::send`] decided in the claim's transaction
//! and committing it (a crash before the commit rolls everything back: the rows are claimed again,
//! the published ones re-sent, at-least-once), then reporting it: metrics, the dead letters' and
//! held topics' logs, the slow-batch warning, the breaker on an outage, and the batch's outcome.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};
use opentelemetry::KeyValue;
use outbox_shared::ClaimedMessage;
use outbox_shared::store::dead_letter::Failure;
use outbox_shared::store::settle::{self, settle};
use sqlx::{Postgres, Transaction};
use tracing::Instrument as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

use crate::batch::claim::Claimed;
use crate::batch::decide::Decision;
use crate::batch::dispatch::Dispatch;
use crate::batch::send::Sent;
use crate::error::DispatcherError;

/// What one batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Settled {
    /// Rows claimed.
    pub claimed: usize,
    /// Published and recorded.
    pub published: usize,
    /// Scheduled for another attempt.
    pub retried: usize,
    /// Moved to the dead-letter table.
    pub dead_lettered: usize,
    /// Released untouched (not attempted, held behind a failure on their key, or their topic
    /// refused as a whole).
    pub released: usize,
    /// Rows whose topic Pub/Sub refused as a whole (held: `crate::refusals::hold`), among
    /// `released`.
    pub topic_refused: usize,
    /// Rows refused for quota, waiting without an attempt charged (`crate::refusals::pace`), among
    /// `retried`.
    pub throttled: usize,
    /// A held topic's probe was accepted: the topic is released.
    pub unheld: bool,
}

/// The outcome of [`run_batch`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BatchOutcome {
    /// Nothing was due.
    Empty,
    /// Every claimed row was settled.
    Settled(Settled),
    /// Pub/Sub did not answer: the rows were released untouched and the breaker tripped.
    Outage {
        /// The first error seen.
        error: String,
        /// Rows released.
        released: usize,
    },
}

/// Settles and commits the batch (a span, `settle`), then reports it (the module doc).
pub(crate) async fn finish<P>(
    d: &Dispatch<P>,
    claimed: Claimed<'_>,
    sent: Sent,
    now: DateTime<Utc>,
    timing: Timing,
) -> Result<BatchOutcome, DispatcherError> {
    let Claimed {
        tx,
        messages: claimed,
        give_back,
        in_flight: _in_flight,
    } = claimed;
    let changed = commit(d, tx, &sent.decision, now)
        .instrument(tracing::info_span!("settle", db.system = "postgresql"))
        .await?;
    give_back.settled(&claimed, &sent.decision.settlement.released);
    record(d, &claimed, &sent.decision, &changed, now);
    timing.log_if_slow(d, &claimed, now);
    Ok(outcome(d, &claimed, sent, &changed))
}

/// Writes the decision in the claim's transaction and commits it; a released held topic wakes
/// the dispatchers.
async fn commit<P>(
    d: &Dispatch<P>,
    mut tx: Transaction<'static, Postgres>,
    decision: &Decision,
    now: DateTime<Utc>,
) -> Result<settle::Settled, DispatcherError> {
    let changed = settle(
        &mut tx,
        &decision.settlement,
        d.settings.retain_published,
        now,
        d.refusals.held_probe_interval,
    )
    .await?;
    if !changed.unheld.is_empty()
        && let Some(channel) = &d.notify_channel
    {
        // The released topic's rows are claimable again: wake the dispatchers.
        outbox_shared::notify(&mut tx, channel).await?;
    }
    tx.commit()
        .await
        .map_err(|source| outbox_shared::Error::Database {
            context: "committing a settled batch",
            source,
        })?;
    Ok(changed)
}

/// The committed batch's outcome; an outage trips the breaker (and marks the batch's span).
fn outcome<P>(
    d: &Dispatch<P>,
    claimed: &[ClaimedMessage],
    sent: Sent,
    changed: &settle::Settled,
) -> BatchOutcome {
    let Sent {
        decision,
        outage,
        started,
    } = sent;
    match outage {
        Some(error) => {
            if outbox_runtime::traces::on() {
                let span = tracing::Span::current();
                span.record("otel.status_code", "ERROR");
                span.record("otel.status_message", error.as_str());
                span.add_event(
                    "outage: the batch was released untouched",
                    vec![KeyValue::new("error.message", error.clone())],
                );
            }
            d.metrics.outage_batches.inc();
            let topic = first_sent_topic(claimed, &decision);
            d.breaker.trip(topic, &error, started);
            BatchOutcome::Outage {
                error,
                released: decision.settlement.released.len(),
            }
        }
        None => {
            let s = &decision.settlement;
            let refused: HashSet<&str> = s.holds.iter().map(|h| h.topic.as_str()).collect();
            let released: HashSet<i64> = s.released.iter().copied().collect();
            BatchOutcome::Settled(Settled {
                claimed: claimed.len(),
                published: s.published.len(),
                retried: s.retries.len(),
                dead_lettered: s.dead_letters.len(),
                released: s.released.len(),
                topic_refused: claimed
                    .iter()
                    .filter(|m| released.contains(&m.id) && refused.contains(m.topic.as_str()))
                    .count(),
                throttled: decision.throttled,
                unheld: !changed.unheld.is_empty(),
            })
        }
    }
}

fn first_sent_topic<'a>(claimed: &'a [ClaimedMessage], decision: &Decision) -> &'a str {
    let released: HashSet<i64> = decision.settlement.released.iter().copied().collect();
    claimed
        .iter()
        .find(|m| released.contains(&m.id))
        .or(claimed.first())
        .map_or("", |m| m.topic.as_str())
}

/// When each step of a batch ended, for the slow-batch log (`--slow-batch`): where the time of
/// a late message went (waiting to be claimed, the claim, the publish, the settlement).
pub(crate) struct Timing {
    /// The batch began (before its claim's `BEGIN`).
    pub(crate) started: Instant,
    /// Its claim ended.
    pub(crate) claimed: Instant,
    /// Its send ended (isolation and probes included).
    pub(crate) sent: Instant,
    /// It was a held topic's probe: its head row waited for the hold, not for a slow dispatcher,
    /// and the hold has its own gauge and warning (status, `outbox_topic_held_seconds`).
    pub(crate) probe: bool,
}

impl Timing {
    /// The batch committed: a warning with each step's time when it was slow, or its oldest row
    /// had waited `--slow-batch` to be claimed; at most one a second per process (`held_back`
    /// counts the slow batches not logged since the last line).
    fn log_if_slow<P>(&self, d: &Dispatch<P>, claimed: &[ClaimedMessage], now: DateTime<Utc>) {
        let threshold = d.settings.slow_batch;
        let total = self.started.elapsed();
        let waited = claimed
            .iter()
            .map(|m| m.created_at)
            .min()
            .and_then(|oldest| (now - oldest).to_std().ok())
            .unwrap_or_default();
        if self.probe || threshold.is_zero() || (total < threshold && waited < threshold) {
            return;
        }
        let Some(held_back) = d.slow_log.pass() else {
            return;
        };
        let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
        tracing::warn!(
            batch.size = claimed.len(),
            wait_ms = ms(waited),
            claim_ms = ms(self.claimed - self.started),
            publish_ms = ms(self.sent - self.claimed),
            settle_ms = ms(self.sent.elapsed()),
            total_ms = ms(total),
            held_back,
            "Slow batch: wait_ms is how long its oldest row waited to be claimed, the other fields \
             what each step took (publish_ms includes the byte budget's wait, isolation and \
             probes; settle_ms the commit); the runbook in docs/operating.md, \"A message was late\", \
             says what each points at."
        );
    }
}

/// Metrics and logs of a settled batch (after the commit: only what is durable is reported), and
/// the held topics it started or ended in this replica's memory.
fn record<P>(
    d: &Dispatch<P>,
    claimed: &[ClaimedMessage],
    decision: &Decision,
    changed: &settle::Settled,
    now: DateTime<Utc>,
) {
    let s = &decision.settlement;
    let published: HashSet<i64> = s.published.iter().map(|(id, _)| *id).collect();
    for m in claimed.iter().filter(|m| published.contains(&m.id)) {
        let lag = (now - m.created_at).num_milliseconds().max(0) as f64 / 1000.0;
        d.metrics.lag_seconds.observe(lag);
    }
    d.metrics.published.inc_by(s.published.len() as u64);
    d.metrics.retried.inc_by(s.retries.len() as u64);
    if outbox_runtime::traces::on() && !s.retries.is_empty() {
        let span = tracing::Span::current();
        for r in &s.retries {
            span.add_event(
                "retry scheduled",
                vec![
                    KeyValue::new("outbox.id", r.id),
                    KeyValue::new("outbox.attempt", i64::from(r.attempts)),
                    KeyValue::new("outbox.next_attempt_at", r.next_attempt_at.to_rfc3339()),
                    KeyValue::new("error.message", r.last_error.clone()),
                ],
            );
        }
    }
    for f in &s.dead_letters {
        d.metrics.dead_letter(f.kind, 1);
        let dead_letter_id = changed
            .dead_letter_ids
            .iter()
            .find(|(outbox_id, _)| *outbox_id == f.id)
            .map(|(_, id)| *id);
        if let Some(m) = claimed.iter().find(|m| m.id == f.id) {
            log_dead_letter(d, m, f, dead_letter_id);
        }
    }
    for hold in &s.holds {
        d.holds.add(&hold.topic, &hold.code, &hold.message, now);
        if changed.held.contains(&hold.topic) {
            let waiting = claimed.iter().filter(|m| m.topic == hold.topic).count();
            tracing::warn!(
                pubsub.topic = %hold.topic, code = %hold.code, error = %hold.message,
                first_probe = ?d.refusals.held_probe_interval,
                max_probe_interval = ?d.refusals.held_max_probe_interval,
                batch_rows = waiting,
                "Pub/Sub refuses the topic as a whole, not a message of it: the topic is held. Its \
                 rows wait untouched (no attempt charged, nothing dead-lettered, every key in \
                 order), the other topics flow, and it is probed with its head message until Pub/Sub \
                 accepts it. If it does not clear within minutes: docs/operating.md, \"A topic is held\"."
            );
        }
    }
    for topic in &changed.unheld {
        d.holds.remove(topic);
        tracing::info!(
            pubsub.topic = %topic,
            "Pub/Sub accepts the held topic again: it is released and its rows flow."
        );
    }
}

fn log_dead_letter<P>(
    d: &Dispatch<P>,
    m: &ClaimedMessage,
    f: &Failure,
    dead_letter_id: Option<i64>,
) {
    match m.ordering_key.as_deref() {
        Some(key) if !d.settings.skip_dead_letter_topics.contains(&m.topic) => tracing::error!(
            dead_letter.id = dead_letter_id, outbox.id = f.id, outbox.dedupe_key = %m.dedupe_key,
            pubsub.topic = %m.topic, pubsub.ordering_key = key, error.kind = f.kind.as_str(),
            error = %f.error,
            "Ordering key BLOCKED: its message was dead-lettered (dispatcher dead-letters show \
             <dead_letter.id>) and the later messages of the key wait; replay or discard the dead \
             letter to release the key."
        ),
        _ => tracing::error!(
            dead_letter.id = dead_letter_id, outbox.id = f.id, outbox.dedupe_key = %m.dedupe_key,
            pubsub.topic = %m.topic, error.kind = f.kind.as_str(), error = %f.error,
            "Message dead-lettered: inspect it (dispatcher dead-letters show <dead_letter.id>), \
             then replay or discard it."
        ),
    }
}
