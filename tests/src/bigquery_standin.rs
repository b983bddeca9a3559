//! A BigQuery stand-in for throughput: `jobs.query` and `jobs.getQueryResults` over HTTP/1.1
//! with real BigQuery's wire shapes, serving a table generated in memory, at almost no cost per
//! row, with a delay per call and a transfer rate per byte (so page sizing is measured honestly).
//!
//! What it mirrors of BigQuery (and bqemulator does not, or not cheaply): a result is cut at
//! `maxResults` rows **and** at ~10 MB per answer (a page token then says where to go on);
//! `totalRows` in every complete answer; `startIndex` reads of any row range; the query's
//! `@watermark_ts` / `@watermark_key` (INT64) honoured, so a rerun reads only what is new.
//! Rows are rendered to JSON once, when the table is made; serving a page copies bytes.
//!
//! Not a general emulator: one table per stand-in, the query text is ignored.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

/// BigQuery's cap on one answer's size (10 MB).
pub const MAX_ANSWER_BYTES: usize = 10 * 1024 * 1024;

/// The generated table: `id INT64, ts_micros INT64, updated_at TIMESTAMP, customer_id STRING,
/// amount NUMERIC, body STRING` (a JSON document of about `body_bytes`), ordered by
/// `(ts_micros, id)`; `customer_id` cycles over `customers` values.
#[derive(Debug)]
pub struct Table {
    /// Each row as BigQuery's `{"f":[{"v":…},…]}`.
    rows: Vec<String>,
    /// Each row's cursor `(ts_micros, id)`.
    cursors: Vec<(i64, i64)>,
}

/// The first row's timestamp (2026-01-01T00:00:00Z) in microseconds.
pub const FIRST_TS_MICROS: i64 = 1_767_225_600_000_000;

impl Table {
    /// `n` rows of about `body_bytes` of JSON each, over `customers` ordering keys; two rows
    /// share each timestamp (the key column tells them apart).
    pub fn generate(n: usize, customers: usize, body_bytes: usize) -> Self {
        let mut rows = Vec::with_capacity(n);
        let mut cursors = Vec::with_capacity(n);
        let filler: String = "abcdefghijklmnopqrstuvwxyz0123456789"
            .chars()
            .cycle()
            .take(body_bytes.saturating_sub(120))
            .collect();
        for i in 0..n {
            let id = i as i64 + 1;
            let ts = FIRST_TS_MICROS + (i as i64 / 2) * 1_000;
            let customer = format!("cust-{:06}", i % customers.max(1));
            let amount = format!("{}.{:02}", (i * 37) % 100_000, i % 100);
            let body = serde_json::json!({
                "order_id": id,
                "customer": customer,
                "status": if i % 3 == 0 { "paid" } else { "open" },
                "lines": i % 7 + 1,
                "note": filler,
            })
            .to_string();
            let cells = [
                Value::String(id.to_string()),
                Value::String(ts.to_string()),
                Value::String(ts.to_string()),
                Value::String(customer),
                Value::String(amount),
                Value::String(body),
            ];
            let f: Vec<Value> = cells
                .into_iter()
                .map(|v| serde_json::json!({ "v": v }))
                .collect();
            rows.push(serde_json::json!({ "f": f }).to_string());
            cursors.push((ts, id));
        }
        Self { rows, cursors }
    }

    /// Rows in the table.
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    /// Whether the table has no rows.
    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The last row's cursor `(ts_micros, id)`.
    pub fn last_cursor(&self) -> Option<(i64, i64)> {
        self.cursors.last().copied()
    }

    /// Bytes of one row on the wire, on average.
    pub fn row_bytes(&self) -> usize {
        let total: usize = self.rows.iter().map(|r| r.len() + 1).sum();
        total / self.rows.len().max(1)
    }

    /// The row at `i` as the cells the producer's mapping gives: `(id, ts, customer, amount, body)`.
    pub fn cells(&self, i: usize) -> Option<Vec<String>> {
        let row: Value = serde_json::from_str(self.rows.get(i)?).ok()?;
        row["f"]
            .as_array()?
            .iter()
            .map(|c| c["v"].as_str().map(str::to_owned))
            .collect()
    }

    /// The first row after the cursor `(ts, id)`.
    fn after(&self, ts: i64, id: i64) -> usize {
        self.cursors.partition_point(|&c| c <= (ts, id))
    }

    fn schema() -> Value {
        let field =
            |name: &str, t: &str| serde_json::json!({"name": name, "type": t, "mode": "NULLABLE"});
        serde_json::json!({"fields": [
            field("id", "INTEGER"),
            field("ts_micros", "INTEGER"),
            field("updated_at", "TIMESTAMP"),
            field("customer_id", "STRING"),
            field("amount", "NUMERIC"),
            field("body", "STRING"),
        ]})
    }
}

/// How the stand-in answers.
#[derive(Debug, Clone, Copy)]
pub struct Wire {
    /// Added to every call before it answers.
    pub delay: Duration,
    /// Bytes per second an answer is sent at (None: as fast as loopback goes).
    pub bytes_per_second: Option<u64>,
}

#[derive(Debug, Default)]
struct Counters {
    calls: AtomicU64,
    bytes: AtomicU64,
    jobs: AtomicU64,
}

#[derive(Debug)]
struct Job {
    /// The result's first row in the table.
    offset: usize,
}

#[derive(Debug)]
struct State {
    table: Arc<Table>,
    wire: Wire,
    counters: Counters,
    jobs: std::sync::Mutex<Vec<Job>>,
}

/// A running stand-in; stops when dropped.
#[derive(Debug)]
pub struct StandIn {
    addr: SocketAddr,
    state: Arc<State>,
    task: AbortHandle,
}

impl Drop for StandIn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl StandIn {
    /// Serves `table` on a free loopback port.
    pub async fn start(table: Arc<Table>, wire: Wire) -> std::io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            table,
            wire,
            counters: Counters::default(),
            jobs: std::sync::Mutex::new(Vec::new()),
        });
        let serving = Arc::clone(&state);
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let _ = stream.set_nodelay(true);
                tokio::spawn(serve(stream, Arc::clone(&serving)));
            }
        })
        .abort_handle();
        Ok(Self { addr, state, task })
    }

    /// The endpoint for `--bigquery-endpoint` (`http://127.0.0.1:PORT`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Calls answered so far.
    pub fn calls(&self) -> u64 {
        self.state.counters.calls.load(Ordering::Relaxed)
    }

    /// Body bytes sent so far.
    pub fn bytes_sent(&self) -> u64 {
        self.state.counters.bytes.load(Ordering::Relaxed)
    }
}

/// One connection: requests one after another (keep-alive), as reqwest sends them.
async fn serve(mut stream: TcpStream, state: Arc<State>) {
    let mut buf = Vec::with_capacity(8192);
    loop {
        let Some((head, body)) = read_request(&mut stream, &mut buf).await else {
            return;
        };
        let (status, answer) = answer(&state, &head, &body);
        let wire = state.wire;
        let mut pause = wire.delay;
        if let Some(rate) = wire.bytes_per_second.filter(|r| *r > 0) {
            pause += Duration::from_secs_f64(answer.len() as f64 / rate as f64);
        }
        if !pause.is_zero() {
            tokio::time::sleep(pause).await;
        }
        state.counters.calls.fetch_add(1, Ordering::Relaxed);
        state
            .counters
            .bytes
            .fetch_add(answer.len() as u64, Ordering::Relaxed);
        let header = format!(
            "HTTP/1.1 {status}\r\nContent-Type: application/json; charset=UTF-8\r\nContent-Length: {}\r\n\r\n",
            answer.len()
        );
        if stream.write_all(header.as_bytes()).await.is_err()
            || stream.write_all(answer.as_bytes()).await.is_err()
        {
            return;
        }
    }
}

/// Reads one request: the head (request line and headers) and its `Content-Length` body.
async fn read_request(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<(String, Vec<u8>)> {
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            let length = head
                .lines()
                .filter_map(|l| l.split_once(':'))
                .find(|(k, _)| k.trim().eq_ignore_ascii_case("content-length"))
                .and_then(|(_, v)| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            while buf.len() < end + 4 + length {
                read_more(stream, buf).await?;
            }
            let body = buf[end + 4..end + 4 + length].to_vec();
            buf.drain(..end + 4 + length);
            return Some((head, body));
        }
        read_more(stream, buf).await?;
    }
}

async fn read_more(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Option<()> {
    let mut chunk = [0u8; 8192];
    match stream.read(&mut chunk).await {
        Ok(0) | Err(_) => None,
        Ok(n) => {
            buf.extend_from_slice(&chunk[..n]);
            Some(())
        }
    }
}

/// The answer to one request: `POST …/queries` or `GET …/queries/<job>?…`.
fn answer(state: &State, head: &str, body: &[u8]) -> (&'static str, String) {
    let line = head.lines().next().unwrap_or_default();
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let param = |name: &str| {
        query
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.to_owned())
    };
    match (method, path.rsplit_once("/queries")) {
        ("POST", Some((_, ""))) => start_job(state, body),
        ("GET", Some((_, job))) => {
            let job = job.trim_start_matches('/');
            let Some(offset) = job
                .strip_prefix("job_")
                .and_then(|n| n.parse::<usize>().ok())
                .and_then(|n| state.jobs.lock().ok()?.get(n).map(|j| j.offset))
            else {
                return not_found(job);
            };
            let start = param("pageToken")
                .or_else(|| param("startIndex"))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0usize);
            let max = param("maxResults")
                .and_then(|v| v.parse().ok())
                .unwrap_or(usize::MAX);
            ("200 OK", page(state, job, offset, start, max, false))
        }
        _ => not_found(path),
    }
}

fn not_found(what: &str) -> (&'static str, String) {
    let message = format!("Not found: {what}");
    let body = serde_json::json!({"error": {"code": 404, "message": message,
        "errors": [{"reason": "notFound", "message": message}], "status": "NOT_FOUND"}});
    ("404 Not Found", body.to_string())
}

/// `jobs.query`: a job over the rows after the watermark parameters, complete at once.
fn start_job(state: &State, body: &[u8]) -> (&'static str, String) {
    let request: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let number = |name: &str| -> Option<i64> {
        request["queryParameters"]
            .as_array()?
            .iter()
            .find(|p| p["name"] == name)?["parameterValue"]["value"]
            .as_str()?
            .parse()
            .ok()
    };
    let offset = match (number("watermark_ts"), number("watermark_key")) {
        (Some(ts), Some(id)) => state.table.after(ts, id),
        _ => 0,
    };
    let job = {
        let Ok(mut jobs) = state.jobs.lock() else {
            return ("500 Internal Server Error", "{}".to_owned());
        };
        jobs.push(Job { offset });
        format!("job_{}", jobs.len() - 1)
    };
    state.counters.jobs.fetch_add(1, Ordering::Relaxed);
    if request["dryRun"] == true {
        let bytes = (state.table.len() * state.table.row_bytes()).to_string();
        let body = serde_json::json!({"kind": "bigquery#queryResponse", "schema": Table::schema(),
            "jobReference": {"projectId": "bench", "jobId": job, "location": "US"},
            "totalBytesProcessed": bytes, "jobComplete": true, "cacheHit": false});
        return ("200 OK", body.to_string());
    }
    let max = request["maxResults"]
        .as_u64()
        .map_or(usize::MAX, |m| m as usize);
    ("200 OK", page(state, &job, offset, 0, max, true))
}

/// One complete answer: rows `start..` of the job's result, at most `max` rows and at most
/// [`MAX_ANSWER_BYTES`], a page token when more follow, `totalRows` always.
fn page(state: &State, job: &str, offset: usize, start: usize, max: usize, query: bool) -> String {
    let table = &state.table;
    let total = table.len().saturating_sub(offset);
    let from = (offset + start).min(table.len());
    let mut out = String::with_capacity(64 * 1024);
    let kind = if query {
        "bigquery#queryResponse"
    } else {
        "bigquery#getQueryResultsResponse"
    };
    out.push_str(&format!(
        r#"{{"kind":"{kind}","jobReference":{{"projectId":"bench","jobId":"{job}","location":"US"}},"jobComplete":true,"totalBytesProcessed":"{}","totalRows":"{total}","schema":{},"rows":["#,
        total * table.row_bytes(),
        Table::schema()
    ));
    let mut end = from;
    while end < table.len() && end - from < max {
        let row = &table.rows[end];
        if end > from && out.len() + row.len() + 64 > MAX_ANSWER_BYTES {
            break;
        }
        if end > from {
            out.push(',');
        }
        out.push_str(row);
        end += 1;
    }
    out.push(']');
    if end < table.len() {
        out.push_str(&format!(r#","pageToken":"{}""#, end - offset));
    }
    out.push('}');
    out
}
