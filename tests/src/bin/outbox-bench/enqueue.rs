//! `outbox-bench enqueue`: the producer's bulk insert (`enqueue_batch`, `INSERT … SELECT FROM
//! UNNEST`) against binary `COPY … FROM STDIN` of the same rows, one stream each, interleaved.
//!
//! Both write 5,000 rows per statement and transaction (as `Scratch::refill`) into an emptied
//! outbox. The COPY side encodes PostgreSQL's binary copy format by hand ([`encode_copy`]); after
//! every COPY run the row count and sample rows are read back and compared field by field, so a
//! figure is only printed for an encoding proven to round-trip. COPY is not a drop-in enqueue:
//! it has no `ON CONFLICT DO NOTHING`, so a duplicate dedupe key fails the whole chunk.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use outbox_shared::{NewMessage, enqueue_batch};
use sqlx::PgConnection;

use crate::report::summary;
use crate::scratch::Scratch;

/// Rows per statement and transaction (the fill chunk of `Scratch::refill`).
const CHUNK: usize = 5_000;

const TOPIC: &str = "projects/outbox-bench/topics/enqueue";

/// The column list of the COPY, in the order [`encode_copy`] writes the fields.
const COPY_STATEMENT: &str = "COPY pubsub_outbox (topic, ordering_key, dedupe_key, payload, attributes) \
     FROM STDIN (FORMAT binary)";

#[derive(Debug, clap::Args)]
pub struct EnqueueArgs {
    /// Rows written per run and method.
    #[arg(long, default_value_t = 200_000)]
    pub rows: usize,
    /// Runs per method, interleaved (the median is reported).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Payload bytes per row.
    #[arg(long, default_value_t = 1024)]
    pub payload_bytes: usize,
}

/// The rows of chunk `[start, end)`: as `Scratch::refill` writes them, plus one attribute and an
/// ordering key on every 100th row, so the COPY encoding of non-empty JSON and of a non-NULL key
/// is exercised and checked too.
fn messages(start: usize, end: usize, payload_bytes: usize) -> Vec<NewMessage> {
    (start..end)
        .map(|i| NewMessage {
            topic: TOPIC.to_owned(),
            ordering_key: (i % 100 == 0).then(|| format!("key-{}", i % 16)),
            dedupe_key: format!("bench-{i}"),
            payload: (0..payload_bytes).map(|j| (i ^ j) as u8).collect(),
            attributes: [("row".to_owned(), i.to_string())].into(),
            trace_context: None,
        })
        .collect()
}

/// Encodes `rows` as one complete PGCOPY binary stream: header, one tuple per row with the
/// fields of [`COPY_STATEMENT`], trailer.
fn encode_copy(rows: &[NewMessage]) -> Result<Vec<u8>> {
    fn field(out: &mut Vec<u8>, bytes: Option<&[u8]>) -> Result<()> {
        match bytes {
            // A NULL is a length of -1 and no bytes.
            None => out.extend_from_slice(&(-1i32).to_be_bytes()),
            Some(b) => {
                let len = i32::try_from(b.len()).context("a field longer than 2 GiB")?;
                out.extend_from_slice(&len.to_be_bytes());
                out.extend_from_slice(b);
            }
        }
        Ok(())
    }
    let mut out = Vec::with_capacity(rows.iter().map(|m| m.payload.len() + 96).sum::<usize>());
    // Signature, flags (no OIDs), header extension length.
    out.extend_from_slice(b"PGCOPY\n\xff\r\n\0");
    out.extend_from_slice(&0i32.to_be_bytes());
    out.extend_from_slice(&0i32.to_be_bytes());
    for m in rows {
        out.extend_from_slice(&5i16.to_be_bytes());
        field(&mut out, Some(m.topic.as_bytes()))?;
        field(&mut out, m.ordering_key.as_deref().map(str::as_bytes))?;
        field(&mut out, Some(m.dedupe_key.as_bytes()))?;
        // bytea's binary form is the raw bytes.
        field(&mut out, Some(&m.payload))?;
        // jsonb's binary form is a version byte (1) followed by the JSON text.
        let mut json = vec![1u8];
        serde_json::to_writer(&mut json, &m.attributes).context("encoding attributes")?;
        field(&mut out, Some(&json))?;
    }
    out.extend_from_slice(&(-1i16).to_be_bytes());
    Ok(out)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Method {
    Unnest,
    Copy,
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Unnest => "enqueue_batch (INSERT … SELECT FROM UNNEST)",
            Self::Copy => "binary COPY",
        })
    }
}

pub async fn enqueue_bench(db: &Scratch, args: &EnqueueArgs) -> Result<()> {
    ensure!(
        args.rows > 0 && args.runs > 0,
        "--rows and --runs must be positive"
    );
    let mut conn = db.db.pool.acquire().await?;
    let mut rates: Vec<(f64, f64)> = Vec::with_capacity(args.runs);
    for run in 1..=args.runs {
        let unnest = enqueue_run(&mut conn, args, Method::Unnest).await?;
        let copy = enqueue_run(&mut conn, args, Method::Copy).await?;
        verify_copy(&mut conn, args).await?;
        println!(
            "enqueue run {run}/{}: enqueue_batch {unnest:.0} rows/s; binary COPY {copy:.0} rows/s \
             (verified: {} rows, sample rows round-trip); copy/enqueue {:.2}",
            args.runs,
            args.rows,
            copy / unnest
        );
        rates.push((unnest, copy));
    }
    println!("\n| method | median rows/s | min | max | runs |");
    println!("|---|---|---|---|---|");
    let unnest = summary(rates.iter().map(|r| r.0));
    let copy = summary(rates.iter().map(|r| r.1));
    for (method, s) in [(Method::Unnest, unnest), (Method::Copy, copy)] {
        println!(
            "| {method} | {:.0} | {:.0} | {:.0} | {} |",
            s.median,
            s.min,
            s.max,
            rates.len()
        );
    }
    let ratio = summary(rates.iter().map(|(unnest, copy)| copy / unnest));
    println!(
        "\ncopy/enqueue per run: median {:.2}, min {:.2}, max {:.2} ({} rows of {} B per run, {CHUNK} per transaction)",
        ratio.median, ratio.min, ratio.max, args.rows, args.payload_bytes
    );
    Ok(())
}

/// Empties the outbox and writes `args.rows` rows with `method`; returns rows/s of the time spent
/// encoding, sending and committing (building the rows is not timed, as in `Scratch::refill`).
async fn enqueue_run(conn: &mut PgConnection, args: &EnqueueArgs, method: Method) -> Result<f64> {
    sqlx::raw_sql("TRUNCATE pubsub_outbox")
        .execute(&mut *conn)
        .await
        .context("emptying the outbox")?;
    let mut spent = Duration::ZERO;
    let mut written = 0u64;
    for start in (0..args.rows).step_by(CHUNK) {
        let chunk = messages(start, args.rows.min(start + CHUNK), args.payload_bytes);
        let started = Instant::now();
        let mut tx = sqlx::Connection::begin(&mut *conn).await?;
        written += match method {
            Method::Unnest => enqueue_batch(&mut tx, &chunk).await?.inserted,
            Method::Copy => {
                let mut copy = tx
                    .copy_in_raw(COPY_STATEMENT)
                    .await
                    .context("starting the COPY")?;
                copy.send(encode_copy(&chunk)?)
                    .await
                    .context("sending COPY data")?;
                copy.finish().await.context("finishing the COPY")?
            }
        };
        tx.commit().await.context("committing an enqueue chunk")?;
        spent += started.elapsed();
    }
    if written != args.rows as u64 {
        bail!("{method} wrote {written} of {} rows", args.rows);
    }
    Ok(args.rows as f64 / spent.as_secs_f64())
}

type StoredRow = (
    String,
    Option<String>,
    String,
    Vec<u8>,
    sqlx::types::Json<outbox_shared::Attributes>,
);

/// Checks that the COPY run left exactly `args.rows` rows and that sample rows (first, keyed,
/// last) read back exactly as they were generated.
async fn verify_copy(conn: &mut PgConnection, args: &EnqueueArgs) -> Result<()> {
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM pubsub_outbox")
        .fetch_one(&mut *conn)
        .await
        .context("counting the copied rows")?;
    ensure!(
        count == args.rows as i64,
        "binary COPY left {count} rows, expected {}",
        args.rows
    );
    let keyed = (args.rows - 1) / 100 * 100;
    for i in [0, keyed, args.rows - 1, args.rows / 2] {
        let expected = messages(i, i + 1, args.payload_bytes).remove(0);
        let row: StoredRow = sqlx::query_as(
            "SELECT topic, ordering_key, dedupe_key, payload, attributes
             FROM pubsub_outbox WHERE dedupe_key = $1",
        )
        .bind(&expected.dedupe_key)
        .fetch_one(&mut *conn)
        .await
        .with_context(|| format!("reading back copied row {}", expected.dedupe_key))?;
        let (topic, ordering_key, dedupe_key, payload, attributes) = row;
        ensure!(
            topic == expected.topic
                && ordering_key == expected.ordering_key
                && dedupe_key == expected.dedupe_key
                && payload == expected.payload
                && attributes.0 == expected.attributes,
            "copied row {} does not round-trip: got topic {topic:?}, key {ordering_key:?}, \
             {} payload bytes, attributes {:?}",
            expected.dedupe_key,
            payload.len(),
            attributes.0
        );
    }
    Ok(())
}
