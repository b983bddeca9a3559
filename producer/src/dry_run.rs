//! `--dry-run`: what a run would do, without writing anything.
//!
//! Asks BigQuery (a dry-run job, free) how many bytes the query would process, then runs the query
//! (billed like a real run and capped by `maximum_bytes_billed`), maps every row and reports what
//! would be enqueued or rejected, with a few sample messages. It reads the watermark but takes no
//! lock and writes no ledger row. It cannot tell which messages the outbox already holds, so its
//! `enqueued` counts every message that would be offered.

use std::time::Instant;

use outbox_shared::store::watermark;
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::bigquery::{Api, BigQuery};
use crate::config::Stream;
use crate::cursor::Position;
use crate::errors::{Error, InStream};
use crate::job::Settings;
use crate::mapping::Mapper;
use crate::report::{StreamOutcome, StreamSummary};
use crate::run::{db_error, order_error, pages_error, query_spec};

pub(crate) async fn dry_run_stream<A: Api>(
    pool: &PgPool,
    bq: &BigQuery<A>,
    stream: &Stream,
    settings: &Settings,
) -> Result<StreamSummary, Error> {
    let name = stream.name.as_str();
    let started = Instant::now();
    let mut conn = pool
        .acquire()
        .await
        .map_err(|e| db_error(name, "connecting for the dry run", e))?;
    let stored = watermark::get(&mut conn, name).await.in_stream(name)?;
    drop(conn);
    let stored = stored.and_then(|c| Position::from_cursor(&c, stream.cursor.key_type));
    let lower = Position::lower_bound(stored.as_ref(), stream.lookback, stream.cursor.key_type);
    let spec = query_spec(stream, &lower, settings.page_size);

    let estimate = bq
        .estimate_bytes(&spec)
        .await
        .map_err(|e| pages_error(name, e))?;
    tracing::info!(stream = name, estimated_bytes = estimate, from = %lower, "dry run: BigQuery's estimate of the bytes the query processes");
    let mut summary = StreamSummary::new(name, StreamOutcome::DryRun);
    summary.bytes_processed = estimate;

    let mut pages = bq.open(&spec).await.map_err(|e| pages_error(name, e))?;
    let mapper = Mapper::new(
        stream,
        pages.schema(),
        &settings.dedupe_attribute,
        &settings.pubsub_project,
    )?;
    let mut previous = lower;
    while let Some(rows) = pages.next_page().await.map_err(|e| pages_error(name, e))? {
        for row in &rows {
            let mapped = mapper.map_row(row)?;
            if mapped.position <= previous {
                return Err(order_error(
                    name,
                    &previous,
                    &mapped.position,
                    summary.fetched == 0,
                ));
            }
            previous = mapped.position;
            summary.fetched += 1;
            let sample = match mapped.outcome {
                Ok(m) => {
                    summary.enqueued += 1;
                    sample(&m, None)
                }
                Err(r) => {
                    summary.rejected += 1;
                    sample(&r.message, Some(&r.reason))
                }
            };
            if summary.samples.len() < settings.dry_run_sample {
                summary.samples.push(sample);
            }
        }
    }
    if summary.fetched > 0 {
        summary.watermark = Some(previous);
    } else {
        summary.watermark = stored;
    }
    summary.elapsed = started.elapsed();
    Ok(summary)
}

/// A message as JSON for people: the payload as JSON if it is JSON, else text; its size only
/// when it is binary or longer than 4 KiB.
fn sample(m: &outbox_shared::NewMessage, rejected: Option<&str>) -> Value {
    if m.payload.len() > 4096 {
        return sample_with(m, json!({ "bytes": m.payload.len() }), rejected);
    }
    let payload = serde_json::from_slice::<Value>(&m.payload).unwrap_or_else(|_| {
        match std::str::from_utf8(&m.payload) {
            Ok(text) => Value::String(text.to_owned()),
            Err(_) => json!({ "bytes": m.payload.len() }),
        }
    });
    sample_with(m, payload, rejected)
}

fn sample_with(m: &outbox_shared::NewMessage, payload: Value, rejected: Option<&str>) -> Value {
    let mut out = json!({
        "dedupe_key": m.dedupe_key,
        "topic": m.topic,
        "ordering_key": m.ordering_key,
        "attributes": m.attributes,
        "payload": payload,
    });
    if let (Some(reason), Some(obj)) = (rejected, out.as_object_mut()) {
        obj.insert("rejected".into(), Value::String(reason.to_owned()));
    }
    out
}
