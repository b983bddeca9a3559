//! `producer rewind`: move a stream's watermark back so its next run re-reads from there.
//!
//! Safe by construction: the stream's run lock is taken with try (a running execution makes it
//! fail at once, changing nothing) on one connection held until the transaction ends, and the
//! watermark change and its audit row commit together. Only backward moves are accepted: the
//! watermark's promise is "everything at or before it is enqueued", which moving back keeps and
//! moving forward would break (rows in between would never be read).
//!
//! The watermark is stored without its key type, so without `--key` the new key is the smallest
//! of the type the stored key shows: an integer key gets `i64::MIN` (an INT64 key column), any
//! other key `""` (STRING). The next run then re-reads every row at `--to` and after.

use chrono::{DateTime, Utc};
use outbox_runtime::operator::{
    Actor, Command, Common, Confirm, Exit, OpsError, Output, Why, finish, required,
};
use outbox_shared::store::audit::{self, Action, Record};
use outbox_shared::store::lookback;
use outbox_shared::store::watermark::{self, Cursor};
use serde::Serialize;
use serde_json::json;
use sqlx::{Connection, PgConnection, PgPool};

use super::{PositionView, parse_micros};

/// `producer rewind STREAM --to TIMESTAMP [--key K] --reason TEXT`.
#[derive(Debug, Clone, clap::Args)]
pub struct RewindArgs {
    #[command(flatten)]
    pub common: Common,
    /// The stream whose watermark moves back.
    #[arg(value_name = "STREAM")]
    pub stream: String,
    /// The new watermark: an RFC 3339 time (2026-11-30T12:00:00Z) or a duration ago (2h, 30m).
    /// Must be before the current watermark.
    #[arg(long, value_name = "TIMESTAMP")]
    pub to: String,
    /// The new watermark's tie-breaker key: the next run re-reads the rows after (--to, --key).
    /// Default: the smallest key, so every row at --to is re-read too.
    #[arg(long, value_name = "KEY")]
    pub key: Option<String>,
    #[command(flatten)]
    pub why: Why,
    #[command(flatten)]
    pub confirm: Confirm,
}

/// A checked rewind request (built before connecting).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The stream.
    pub stream: String,
    /// The new watermark's timestamp, UNIX microseconds.
    pub to_micros: i64,
    /// The new watermark's key, if given.
    pub key: Option<String>,
    /// Who acts and why.
    pub who: Actor,
    /// Made and rolled back: what it would do.
    pub dry_run: bool,
}

impl Command for RewindArgs {
    type Checked = Request;

    /// Checks the flags (`now` resolves a duration ago).
    fn check(&self, now: DateTime<Utc>) -> Result<Request, OpsError> {
        let stream = required("STREAM", Some(&self.stream), "name the stream to rewind")?;
        let who = self.why.check(
            "say why the stream is rewound (it goes to the audit trail)",
            self.confirm.dry_run,
        )?;
        if self.common.database.pooler.per_transaction() {
            return Err(OpsError::Usage(
                "--db-pooler transaction: rewind takes the stream's lock (a session advisory \
                 lock, so that no run moves the watermark meanwhile), which a transaction-mode \
                 pooler does not keep; run it directly against the database or through a \
                 session-mode pooler"
                    .to_owned(),
            ));
        }
        Ok(Request {
            stream: stream.to_owned(),
            to_micros: parse_micros("--to", &self.to, now)?,
            key: self.key.clone(),
            who,
            dry_run: self.confirm.dry_run,
        })
    }

    async fn run(request: Request, pool: &PgPool) -> Result<Output, OpsError> {
        // Detached: the session lock must end with this command, not live on in a pool.
        let mut conn = pool
            .acquire()
            .await
            .map_err(|source| outbox_shared::Error::Database {
                context: "connecting for the rewind",
                source,
            })?
            .detach();
        let result = rewind(&mut conn, &request).await;
        let _ = conn.close().await;
        let done = result?;
        let view = RewindView {
            stream: done.stream.clone(),
            previous: PositionView::from(&done.previous),
            watermark: PositionView::from(&done.watermark),
            audit_id: done.audit_id,
            dry_run: request.dry_run,
            actor: request.who.actor.clone(),
            reason: request.who.reason.clone(),
        };
        Output::new(render(&done, &request), &view, Exit::Ok)
    }
}

/// What a rewind did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rewound {
    /// The stream.
    pub stream: String,
    /// The watermark before.
    pub previous: Cursor,
    /// The watermark now: the next run re-reads the rows after it through `previous`.
    pub watermark: Cursor,
    /// The audit entry written with it (`None`: a dry run, rolled back).
    pub audit_id: Option<i64>,
    /// A lookback stream: the cursor timestamp of the oldest dedupe key it remembers.
    pub remembers_from: Option<i64>,
}

/// `producer rewind --json`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RewindView {
    /// The stream.
    pub stream: String,
    /// The watermark before.
    pub previous: PositionView,
    /// The watermark now: the next run re-reads the rows after it through `previous`.
    pub watermark: PositionView,
    /// The audit entry (`pubsub_outbox_audit.id`) written in the same transaction (`null` in a
    /// dry run).
    pub audit_id: Option<i64>,
    /// Whether it was a dry run (made and rolled back: nothing changed).
    pub dry_run: bool,
    /// Who said they acted (`null`: none was declared; the audit entry names the login).
    pub actor: Option<String>,
    /// Why.
    pub reason: String,
}

/// Rewinds on `conn`, a session of its own: takes the stream's lock (try), moves the watermark
/// and writes the audit row in one transaction, and releases the lock whatever happened. Released
/// explicitly rather than with the session: a closed session's locks go only once its backend has
/// exited, which may be after this command returned, and a run or rewind started right after
/// would find the stream still locked.
pub async fn rewind(conn: &mut PgConnection, request: &Request) -> Result<Rewound, OpsError> {
    let stream = request.stream.as_str();
    if !watermark::lock(conn, stream, false).await? {
        return Err(OpsError::Failed(format!(
            "stream '{stream}' is being run (another session holds its lock); nothing was \
             changed. Retry when the run has finished (producer streams shows it as running)"
        )));
    }
    let result = rewind_locked(conn, request).await;
    watermark::unlock(conn, stream).await?;
    result
}

/// [`rewind`] with the stream's lock held.
async fn rewind_locked(conn: &mut PgConnection, request: &Request) -> Result<Rewound, OpsError> {
    let stream = request.stream.as_str();
    let mut tx = conn.begin().await.map_err(outbox_shared::Error::begin)?;
    let Some(previous) = watermark::get(&mut tx, stream).await? else {
        let known: Vec<String> = watermark::list(&mut tx)
            .await?
            .into_iter()
            .map(|w| w.stream)
            .collect();
        let close = outbox_runtime::operator::near(stream, known.iter().map(String::as_str));
        return Err(OpsError::NothingMatched(format!(
            "stream '{stream}' has no watermark: it has never committed a page, so its next run \
             reads from the start anyway ({})",
            if close.is_empty() {
                "producer streams lists the known streams".to_owned()
            } else {
                format!("did you mean {}?", close.join(" or "))
            }
        )));
    };
    let to = target(request, &previous)?;
    if !watermark::rewind(&mut tx, stream, &to).await? {
        // Holding the lock nobody else moves it; a forward move was refused by `target`.
        return Err(OpsError::Failed(format!(
            "stream '{stream}': the watermark is no longer after {}; nothing was changed",
            PositionView::from(&to)
        )));
    }
    let selector = json!({
        "stream": stream,
        "to": PositionView::from(&to).timestamp,
        "key": to.key,
        "previous": { "timestamp": PositionView::from(&previous).timestamp, "key": previous.key },
    });
    let audit_id = if request.dry_run {
        None
    } else {
        let entry = Record {
            actor: request.who.actor.as_deref(),
            action: Action::Rewind,
            selector,
            row_ids: &[],
            outbox_ids: None,
            reason: &request.who.reason,
        };
        Some(audit::record(&mut tx, &entry).await?)
    };
    let remembers_from = lookback::oldest(&mut tx, stream).await?;
    // A dry run rolls the rewind back: what it reports is exactly what the rewind would do.
    finish(tx, request.dry_run).await?;
    if !request.dry_run {
        tracing::info!(stream, audit_id, from = %PositionView::from(&previous), to = %PositionView::from(&to), "Rewound the stream's watermark.");
    }
    Ok(Rewound {
        stream: stream.to_owned(),
        previous,
        watermark: to,
        audit_id,
        remembers_from,
    })
}

/// The new watermark for `request`, given the stored one; refuses anything not before it.
pub fn target(request: &Request, current: &Cursor) -> Result<Cursor, OpsError> {
    let integer_keys = current.key.parse::<i64>().is_ok();
    let key = match &request.key {
        Some(k) if integer_keys && k.parse::<i64>().is_err() => {
            return Err(OpsError::Usage(format!(
                "--key {k:?} is not an integer, but stream '{}' stores integer keys (an INT64 key \
                 column); its next run could not use it",
                request.stream
            )));
        }
        Some(k) => k.clone(),
        None if integer_keys => i64::MIN.to_string(),
        None => String::new(),
    };
    let to = Cursor {
        micros: request.to_micros,
        key,
    };
    let earlier = match to.micros.cmp(&current.micros) {
        std::cmp::Ordering::Less => true,
        std::cmp::Ordering::Greater => false,
        std::cmp::Ordering::Equal => match (to.key.parse::<i64>(), current.key.parse::<i64>()) {
            (Ok(a), Ok(b)) if integer_keys => a < b,
            _ => to.key.as_bytes() < current.key.as_bytes(),
        },
    };
    if !earlier {
        return Err(OpsError::Usage(format!(
            "stream '{}': {} is not before its watermark {}; use rewind only to move back (a \
             forward move would skip the rows in between)",
            request.stream,
            PositionView::from(&to),
            PositionView::from(current)
        )));
    }
    Ok(to)
}

/// What people read after a rewind: where it was, where it is, what the next run re-reads and
/// what of it is enqueued again.
fn render(done: &Rewound, request: &Request) -> String {
    let (from, to) = (
        PositionView::from(&done.previous),
        PositionView::from(&done.watermark),
    );
    let span = outbox_runtime::table::duration(
        (done.previous.micros - done.watermark.micros) as f64 / 1_000_000.0,
    );
    let actor = request.who.actor.as_deref().unwrap_or("the database login");
    let (head, now) = match done.audit_id {
        Some(id) => (
            format!(
                "Rewound stream '{}' (audit entry {id}, by {actor}).",
                done.stream
            ),
            "now ",
        ),
        None => (
            format!(
                "Dry run: stream '{}' would be rewound (nothing changed; --reason and no \
                 --dry-run to do it).",
                done.stream
            ),
            "would be",
        ),
    };
    format!(
        "{head}\n\
         \x20 watermark was  {from}\n\
         \x20 watermark {now} {to}\n\
         The next run re-reads the rows after {to} through {from} ({span}), then what is new.\n\
         {again}\n",
        again = enqueued_again(done),
    )
}

/// Which re-read rows are enqueued again: a stream without a lookback re-enqueues the published
/// ones (their outbox rows are gone); one with a lookback skips every key it remembers.
fn enqueued_again(done: &Rewound) -> String {
    const STILL_THERE: &str = "Rows still in the outbox count as duplicates";
    match done.remembers_from {
        None => format!(
            "{STILL_THERE}; rows already published and deleted are enqueued again (consumers \
             drop them by dedupe key)."
        ),
        Some(oldest) if oldest <= done.watermark.micros => format!(
            "{STILL_THERE}; this stream has a lookback and remembers every key it enqueued in the \
             window, so none of the re-read rows is enqueued again, published or not (only rows \
             it never enqueued are)."
        ),
        Some(oldest) => format!(
            "{STILL_THERE}; this stream has a lookback and remembers the keys it enqueued from {}: \
             re-read rows before that which were already published and deleted are enqueued \
             again (consumers drop them by dedupe key), later ones are not.",
            PositionView::from(&Cursor {
                micros: oldest,
                key: String::new()
            })
            .timestamp
            .unwrap_or_else(|| format!("{oldest} µs"))
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(to_micros: i64, key: Option<&str>) -> Request {
        Request {
            stream: "orders".into(),
            to_micros,
            key: key.map(str::to_owned),
            who: Actor {
                reason: "test".into(),
                actor: Some("tester".into()),
            },
            dry_run: false,
        }
    }

    fn cursor(micros: i64, key: &str) -> Cursor {
        Cursor {
            micros,
            key: key.into(),
        }
    }

    #[test]
    fn without_a_key_the_smallest_key_of_the_stored_type_is_used() {
        let int = target(&request(5, None), &cursor(10, "42")).expect("back");
        assert_eq!(int, cursor(5, &i64::MIN.to_string()));
        let text = target(&request(5, None), &cursor(10, "a-42")).expect("back");
        assert_eq!(text, cursor(5, ""));
    }

    #[test]
    fn at_the_same_timestamp_the_key_decides_typed_by_what_is_stored() {
        assert!(target(&request(10, None), &cursor(10, "42")).is_ok());
        assert!(
            target(&request(10, Some("9")), &cursor(10, "42")).is_ok(),
            "9 < 42 as integers"
        );
        assert!(target(&request(10, Some("42")), &cursor(10, "42")).is_err());
        assert!(
            target(&request(10, Some("b")), &cursor(10, "ab")).is_err(),
            "strings compare byte-wise"
        );
    }

    #[test]
    fn a_forward_move_is_refused_as_bad_usage() {
        let e = target(&request(11, None), &cursor(10, "42")).expect_err("forward");
        assert_eq!(e.exit(), Exit::Usage);
        assert!(
            e.to_string().contains("use rewind only to move back"),
            "{e}"
        );
    }

    #[test]
    fn a_text_key_for_an_integer_keyed_stream_is_refused() {
        let e = target(&request(5, Some("abc")), &cursor(10, "42")).expect_err("bad key");
        assert_eq!(e.exit(), Exit::Usage);
    }
}
