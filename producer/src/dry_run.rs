//! `--dry-run`: what a run would do, without writing anything.
//!
//! Asks BigQuery (a dry-run job, free) how many bytes the query would process, then runs the query
//! (billed like a real run and capped by `maximum_bytes_billed`), maps every row and reports what
//! would be enqueued or rejected, with a few sample messages. It reads the watermark by the run's rule
//! (one the stream's key type cannot read fails it) but takes no lock and writes no ledger row. It cannot tell which messages the outbox already holds, so its
//! `enqueued` counts every message that would be offered.

use std::time::Instant;

use serde_json::{Value, json};
use sqlx::PgPool;

use crate::bigquery::{Api, BigQuery};
use crate::config::Stream;
use crate::errors::StreamError;
use crate::reader::{StreamQuery, stored_watermark};
use crate::report::{StreamOutcome, StreamSummary};
use crate::settings::Settings;

/// Dry-runs `stream`: what a run would enqueue or reject, with samples; writes nothing.
#[tracing::instrument(skip_all, fields(stream = %stream.name))]
pub async fn dry_run_stream<A: Api>(
    pool: &PgPool,
    bq: &BigQuery<A>,
    stream: &Stream,
    settings: &Settings,
) -> Result<StreamSummary, StreamError> {
    let name = stream.name.as_str();
    let started = Instant::now();
    let mut conn = pool
        .acquire()
        .await
        .map_err(|e| StreamError::database(name, "connecting for the dry run", e))?;
    let stored = stored_watermark(&mut conn, stream).await?.map(|(_, p)| p);
    drop(conn);
    let query = StreamQuery::new(stream, stored.as_ref(), settings);

    let estimate = query.estimate_bytes(bq).await?;
    tracing::info!(stream = name, estimated_bytes = estimate, from = %query.lower(), "Dry run: BigQuery estimates the bytes the query processes.");
    let mut summary = StreamSummary::new(name, StreamOutcome::DryRun);
    summary.bytes_processed = estimate;

    let mut rows = query.open(bq, settings).await?;
    while let Some(page) = rows.next_page().await? {
        for mapped in page {
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
    summary.watermark = if rows.rows() > 0 {
        Some(rows.last().clone())
    } else {
        stored
    };
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
