//! The producer's test fixtures: the orders table and its stream, streams files and settings, a
//! run of the job in-process (as `producer run` does), and reads of what it left (outbox keys,
//! watermark, summaries). Used by every producer test.

use std::path::PathBuf;
use std::time::Duration;

use gcp_bigquery_client::model::field_type::FieldType;
use gcp_bigquery_client::model::table_field_schema::TableFieldSchema;
use outbox_producer::bigquery::{Api, BigQuery, Rest, Timeouts};
use outbox_producer::{
    JobReport, LoadOptions, Settings, StreamError, StreamSummary, StreamsConfig, run_job,
    select_streams,
};
use outbox_runtime::shutdown::Shutdown;
use outbox_shared::store::watermark;
use serde_json::{Value, json};

use crate::bigquery::{FailFromRow, TestTable};
use crate::db::TestDb;
use crate::env;

/// 2026-11-30T12:00:00Z in UNIX microseconds; test rows are placed relative to it.
pub const BASE_MICROS: i64 = 1_796_040_000_000_000;

/// `micros` as BigQuery writes a TIMESTAMP.
pub fn rfc3339(micros: i64) -> String {
    outbox_producer::value::format_timestamp(micros).expect("timestamp in range")
}

/// The orders table: id, updated_at, customer, status, amount.
pub fn orders_schema() -> Vec<TableFieldSchema> {
    vec![
        TableFieldSchema::integer("id"),
        TableFieldSchema::new("updated_at", FieldType::Timestamp),
        TableFieldSchema::string("customer"),
        TableFieldSchema::string("status"),
        TableFieldSchema::numeric("amount"),
    ]
}

/// An order row updated at `BASE_MICROS + offset_micros`.
pub fn order(id: i64, offset_micros: i64) -> Value {
    json!({
        "id": id,
        "updated_at": rfc3339(BASE_MICROS + offset_micros),
        "customer": format!("c{}", id % 3),
        "status": "new",
        "amount": "12.50",
    })
}

/// The orders stream over `table`, with `extra` TOML lines for the stream's top-level keys.
pub fn orders_toml(table: &TestTable, name: &str, extra: &str) -> String {
    KeyedStream {
        name,
        table,
        topic: "orders",
        columns: &["customer", "status", "amount", "updated_at"],
        attribute: Some(("status", "test")),
        payload: &["id", "customer", "status", "amount", "updated_at"],
        extra,
    }
    .toml()
}

/// A stream over a table of `id`, `updated_at` and a `customer` ordering key (the tests', the
/// chaos run's and the soak's tables), read from its watermark in cursor order.
#[derive(Debug, Clone, Copy)]
pub struct KeyedStream<'a> {
    /// The stream's name (its dedupe keys are `<name>:<id>`).
    pub name: &'a str,
    /// The BigQuery table it reads.
    pub table: &'a TestTable,
    /// The Pub/Sub topic it writes to.
    pub topic: &'a str,
    /// Selected after `id` and the cursor.
    pub columns: &'a [&'a str],
    /// A column sent as the attribute of its name, and the fixed `source` attribute.
    pub attribute: Option<(&'a str, &'a str)>,
    /// The payload object's columns.
    pub payload: &'a [&'a str],
    /// TOML lines for the stream's top-level keys.
    pub extra: &'a str,
}

impl KeyedStream<'_> {
    /// The streams file with this one stream.
    pub fn toml(&self) -> String {
        let attributes = match self.attribute {
            Some((column, source)) => format!(
                "\n[stream.attributes]\ncolumns = {{ {column} = \"{column}\" }}\nfixed = {{ source = \"{source}\" }}\n"
            ),
            None => String::new(),
        };
        let quoted: Vec<String> = self.payload.iter().map(|c| format!("\"{c}\"")).collect();
        format!(
            r#"
[[stream]]
name = "{name}"
query = """
SELECT id, UNIX_MICROS(updated_at) AS updated_at_micros, {columns}
FROM {table}
WHERE UNIX_MICROS(updated_at) > @watermark_ts
   OR (UNIX_MICROS(updated_at) = @watermark_ts AND id > @watermark_key)
ORDER BY updated_at_micros, id
"""
dedupe_key = ["id"]
topic = "{topic}"
ordering_key_column = "customer"
{extra}

[stream.cursor]
timestamp_column = "updated_at_micros"
key_column = "id"
key_type = "INT64"
{attributes}
[stream.payload]
columns = [{payload}]
"#,
            name = self.name,
            columns = self.columns.join(", "),
            table = self.table.name(),
            topic = self.topic,
            extra = self.extra,
            payload = quoted.join(", "),
        )
    }
}

/// An orders table of `rows` rows (ids 1…, customers `c0`…`c2` as ordering keys) and a streams
/// file with one stream `name` over it writing to `topic` (the payload: id and customer), for a
/// `producer run` process; the table is kept alive by the caller.
pub async fn orders_stream_file(name: &str, topic: &str, rows: i64) -> (TestTable, PathBuf) {
    let table = TestTable::create(orders_schema()).await;
    table
        .insert(&(1..=rows).map(|i| order(i, i)).collect::<Vec<_>>())
        .await;
    let streams = KeyedStream {
        name,
        table: &table,
        topic,
        columns: &["customer", "status", "amount", "updated_at"],
        attribute: None,
        payload: &["id", "customer"],
        extra: "",
    }
    .toml();
    let path = std::env::temp_dir().join(format!("{}.toml", crate::env::unique_name(name)));
    std::fs::write(&path, streams).expect("write the streams file");
    (table, path)
}

/// A streams file parsed as `producer run` parses it (the test Pub/Sub project).
pub fn load(toml: &str) -> StreamsConfig {
    let options = LoadOptions {
        pubsub_project: env::pubsub_project(),
        dedupe_attribute: "dedupe_key".into(),
    };
    StreamsConfig::parse(toml, "test streams", &options).expect("the test streams config is valid")
}

/// The job's settings with pages of `page_size` rows and fast progress logs.
pub fn settings(page_size: u32) -> Settings {
    Settings {
        page_size,
        pubsub_project: env::pubsub_project(),
        progress_interval: Duration::from_millis(50),
        ..Settings::default()
    }
}

/// The producer's BigQuery client over `api`, in the test project, default time limits.
pub fn bigquery(api: &Rest) -> BigQuery<Rest> {
    BigQuery::new(api.clone(), env::bigquery_project(), Timeouts::default())
}

/// Runs every stream of `config` once, in-process, as `producer run` does.
pub async fn run_all(
    db: &TestDb,
    table: &TestTable,
    config: &StreamsConfig,
    settings: &Settings,
) -> JobReport {
    run_with(db, &bigquery(&table.api), config, settings).await
}

/// [`run_all`] through `bq` (e.g. a [`FailFromRow`] around the table's API).
pub async fn run_with<A: Api>(
    db: &TestDb,
    bq: &BigQuery<A>,
    config: &StreamsConfig,
    settings: &Settings,
) -> JobReport {
    let streams = select_streams(config, settings).expect("streams selected");
    run_job(&db.pool, bq, &streams, settings, &Shutdown::never()).await
}

/// The table's API failing every call that returns rows from row `row` on (1-based).
pub fn failing_from(table: &TestTable, row: u64) -> BigQuery<FailFromRow<Rest>> {
    BigQuery::new(
        FailFromRow::new(table.api.clone(), row),
        env::bigquery_project(),
        Timeouts::default(),
    )
}

/// Stream `i`'s error; panics when it succeeded.
pub fn failure(report: &JobReport, i: usize) -> &StreamError {
    report.streams[i]
        .result
        .as_ref()
        .expect_err("the stream's run fails")
}

/// Nothing of `stream` was written: no outbox row, no watermark, no dead letter.
pub async fn assert_nothing_written(db: &TestDb, stream: &str) {
    assert!(outbox_keys(db).await.is_empty(), "nothing enqueued");
    assert_eq!(
        stored_watermark(db, stream).await,
        None,
        "no watermark stored"
    );
    let dead: i64 = sqlx::query_scalar("SELECT count(*) FROM pubsub_outbox_dead_letter")
        .fetch_one(&db.pool)
        .await
        .expect("count dead letters");
    assert_eq!(dead, 0, "nothing dead-lettered");
}

/// The outbox as `(dedupe_key, payload JSON)` in enqueue order.
pub async fn outbox(db: &TestDb) -> Vec<(String, Value)> {
    let rows: Vec<(String, Vec<u8>)> =
        sqlx::query_as("SELECT dedupe_key, payload FROM pubsub_outbox ORDER BY id")
            .fetch_all(&db.pool)
            .await
            .expect("read the outbox");
    rows.into_iter()
        .map(|(k, p)| {
            (
                k,
                serde_json::from_slice(&p)
                    .unwrap_or_else(|_| Value::String(format!("{} bytes", p.len()))),
            )
        })
        .collect()
}

/// The outbox's dedupe keys in enqueue order.
pub async fn outbox_keys(db: &TestDb) -> Vec<String> {
    outbox(db).await.into_iter().map(|(k, _)| k).collect()
}

/// The stream's stored watermark.
pub async fn stored_watermark(db: &TestDb, stream: &str) -> Option<watermark::Cursor> {
    let mut conn = db.pool.acquire().await.expect("connection");
    watermark::get(&mut conn, stream)
        .await
        .expect("read the watermark")
}

/// The dedupe keys `<stream>:<id>` of `ids`.
pub fn keys(stream: &str, ids: impl IntoIterator<Item = i64>) -> Vec<String> {
    ids.into_iter().map(|i| format!("{stream}:{i}")).collect()
}

/// Stream `i`'s summary; panics with its error when it failed.
pub fn summary(report: &JobReport, i: usize) -> &StreamSummary {
    match &report.streams[i].result {
        Ok(s) => s,
        Err(e) => panic!(
            "stream {} should have succeeded: {e}",
            report.streams[i].stream
        ),
    }
}
