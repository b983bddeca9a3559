//! One query's result, page by page: `jobs.query`, then `jobs.getQueryResults`.
//!
//! - **Pages sized in bytes**: the first page is small ([`FIRST_PAGE_ROWS`] rows at most); from
//!   its rows the reader learns the bytes per row on the wire and asks for pages of about
//!   [`QuerySpec::page_bytes`] (at most [`QuerySpec::page_size`] rows; BigQuery itself cuts a page
//!   at ~10 MB). A 600-byte row gets ~5,300-row pages at 3 MiB, not 1,000: a round trip of 100–500
//!   ms then carries 5x the rows.
//! - **Concurrent reads of one result**: once the job is complete and BigQuery said how many rows
//!   it has (`totalRows`), the rest is read as row ranges (`startIndex` + `maxResults`), up to
//!   [`QuerySpec::parallel_reads`] ranges in flight, handed out strictly in row order. A range
//!   BigQuery answers short (its byte cap) is finished by further calls from where it stopped.
//!   Without `totalRows`, pages follow the page tokens one after another. The first ranges
//!   ramp up from the first page's size (2x, 4x, ...): the first commits start after a small
//!   transfer, not a whole page's.
//! - Memory: at most `parallel_reads` pages in flight plus the one handed out, whatever the
//!   result size.
//! - `jobComplete: false` (a slow query): poll `getQueryResults` (server-side wait `timeoutMs`,
//!   plus a short client backoff) until the job completes or [`Timeouts::job`] passes.
//! - Each call has a timeout and is retried with backoff (bounded: [`Timeouts::retries`]) when
//!   transient: network, 429, every 5xx, an unreadable answer ([`super::rest::classify`]).
//!   `jobs.query` carries a `requestId`, kept across retries, so BigQuery runs it once.
//! - Every call that returns rows asks for TIMESTAMPs as int64 microseconds
//!   (`formatOptions.useInt64Timestamp`): real BigQuery's default float seconds lose microseconds
//!   after 2242. The float form is still parsed ([`crate::decimal::timestamp_micros`]).
//! - Errors BigQuery reports inside a 200 answer (bqemulator does this for failed queries) fail
//!   the query like an HTTP error would.

use std::time::{Duration, Instant};

use backon::{ExponentialBuilder, Retryable};
use std::collections::VecDeque;

use gcp_bigquery_client::model::data_format_options::DataFormatOptions;
use gcp_bigquery_client::model::error_proto::ErrorProto;
use gcp_bigquery_client::model::get_query_results_parameters::GetQueryResultsParameters;
use gcp_bigquery_client::model::query_parameter::QueryParameter;
use gcp_bigquery_client::model::query_request::QueryRequest;
use gcp_bigquery_client::model::query_response::QueryResponse;
use gcp_bigquery_client::model::table_row::TableRow;
use gcp_bigquery_client::model::table_schema::TableSchema;
use tokio::task::JoinHandle;

use super::{Api, ApiError, ApiErrorKind};

/// Server-side wait per `jobs.query` / `getQueryResults` call while a job runs.
const SERVER_WAIT_MS: i32 = 10_000;

/// Rows of the first page, before the reader knows how large a row is.
pub const FIRST_PAGE_ROWS: u32 = 1_000;

/// Rows sampled per page to learn the bytes per row on the wire.
const SAMPLED_ROWS: usize = 16;

/// Time limits of BigQuery calls.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// One HTTP call.
    pub request: Duration,
    /// How long a job may take to complete.
    pub job: Duration,
    /// First pause between polls of an incomplete job (doubles up to 2 s).
    pub poll: Duration,
    /// Retries of a transient failure per call.
    pub retries: usize,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            request: Duration::from_secs(120),
            job: Duration::from_secs(30 * 60),
            poll: Duration::from_millis(100),
            retries: 4,
        }
    }
}

/// What to run.
#[derive(Debug, Clone)]
pub struct QuerySpec {
    /// GoogleSQL text.
    pub query: String,
    /// Named parameters.
    pub params: Vec<QueryParameter>,
    /// Job location.
    pub location: Option<String>,
    /// Cost guard passed as `maximumBytesBilled`.
    pub maximum_bytes_billed: Option<i64>,
    /// At most this many rows per page (`maxResults`).
    pub page_size: u32,
    /// Pages of about this many bytes on the wire (the rows per page follow from the rows seen).
    pub page_bytes: usize,
    /// Row ranges of one result read at once (1: one page after another).
    pub parallel_reads: usize,
}

/// A BigQuery API in a project, with time limits.
#[derive(Debug, Clone)]
pub struct BigQuery<A> {
    api: A,
    project: String,
    timeouts: Timeouts,
}

/// Why a query could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PagesError {
    /// BigQuery refused or failed the query.
    #[error("{0}")]
    Query(String),
    /// Transport failure, unreadable answer, or time limit.
    #[error("{0}")]
    Request(String),
}

impl From<ApiError> for PagesError {
    fn from(e: ApiError) -> Self {
        match e.kind {
            ApiErrorKind::Refused => Self::Query(e.message),
            ApiErrorKind::Transient | ApiErrorKind::Other => Self::Request(e.message),
        }
    }
}

impl<A: Api> BigQuery<A> {
    /// Jobs run (and are billed) in `project`.
    pub fn new(api: A, project: impl Into<String>, timeouts: Timeouts) -> Self {
        Self {
            api,
            project: project.into(),
            timeouts,
        }
    }

    /// The project jobs run in.
    pub fn project(&self) -> &str {
        &self.project
    }

    /// The API calls go through.
    pub fn api(&self) -> &A {
        &self.api
    }

    /// Asks BigQuery (dry run, nothing billed) how many bytes the query would process.
    pub async fn estimate_bytes(&self, spec: &QuerySpec) -> Result<Option<i64>, PagesError> {
        let mut request = request(spec);
        request.dry_run = Some(true);
        request.request_id = None;
        let response = self
            .call("jobs.query (dry run)", || {
                self.api.query(&self.project, request.clone())
            })
            .await?;
        check_errors(response.errors.as_deref(), response.schema.as_ref())?;
        Ok(parse_bytes(response.total_bytes_processed.as_deref()))
    }

    /// Starts the query and waits for it to complete; the first page is then ready.
    pub async fn open(&self, spec: &QuerySpec) -> Result<Pages<'_, A>, PagesError> {
        let started = Instant::now();
        let request = request(spec);
        let first = self
            .call("jobs.query", || {
                self.api.query(&self.project, request.clone())
            })
            .await?;
        let job_id = first
            .job_reference
            .as_ref()
            .and_then(|r| r.job_id.clone())
            .ok_or_else(|| PagesError::Request("jobs.query answered without a job id".into()))?;
        let location = first
            .job_reference
            .as_ref()
            .and_then(|r| r.location.clone())
            .or_else(|| spec.location.clone());
        let mut pages = Pages {
            bq: self,
            job: Job { job_id, location },
            page_size: spec.page_size.max(1),
            page_bytes: spec.page_bytes.max(1),
            parallel_reads: spec.parallel_reads.max(1),
            deadline: started + self.timeouts.job,
            schema: TableSchema::default(),
            bytes_processed: None,
            pending: None,
            next_token: None,
            done: false,
            total_rows: None,
            scheduled: 0,
            ranges: 0,
            sampled: (0, 0),
            reads: VecDeque::new(),
        };
        if first.job_complete == Some(true) {
            pages.accept(first)?;
        } else {
            let rows = pages.first_rows();
            let response = poll_results(self, &pages.job, pages.deadline, None, rows).await?;
            pages.accept(response)?;
        }
        Ok(pages)
    }

    /// One call with a timeout, retried with backoff while transient.
    async fn call<T, F, Fut>(&self, what: &str, mut f: F) -> Result<T, ApiError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, ApiError>>,
    {
        let limit = self.timeouts.request;
        let attempt = || {
            let fut = f();
            async move {
                match tokio::time::timeout(limit, fut).await {
                    Ok(result) => result,
                    Err(_) => Err(ApiError::transient(format!(
                        "{what} did not answer within {limit:?}"
                    ))),
                }
            }
        };
        attempt
            .retry(
                ExponentialBuilder::default()
                    .with_min_delay(self.timeouts.poll.max(Duration::from_millis(1)) * 5)
                    .with_max_delay(Duration::from_secs(10))
                    .with_max_times(self.timeouts.retries)
                    .with_jitter(),
            )
            .when(|e| e.kind == ApiErrorKind::Transient)
            .notify(|e, wait| tracing::warn!(error = %e, retry_in = ?wait, call = what, "A BigQuery call failed; retrying."))
            .await
    }
}

/// Which job a result belongs to.
#[derive(Debug, Clone)]
struct Job {
    job_id: String,
    location: Option<String>,
}

/// One row range being read, by a task of its own (it goes on while the pages before it
/// commit).
type RangeRead = JoinHandle<Result<Vec<TableRow>, PagesError>>;

/// A running or finished query's result, read page by page.
pub struct Pages<'a, A> {
    bq: &'a BigQuery<A>,
    job: Job,
    page_size: u32,
    page_bytes: usize,
    parallel_reads: usize,
    deadline: Instant,
    schema: TableSchema,
    bytes_processed: Option<i64>,
    pending: Option<Vec<TableRow>>,
    next_token: Option<String>,
    done: bool,
    /// Rows in the result, once BigQuery said (then the rest is read by row ranges).
    total_rows: Option<u64>,
    /// Rows read, handed out or being read (the next range starts here).
    scheduled: u64,
    /// Row ranges started so far.
    ranges: u32,
    /// (rows, bytes) sampled so far, for the bytes per row.
    sampled: (usize, usize),
    /// Row ranges in flight, in row order.
    reads: VecDeque<RangeRead>,
}

impl<A> Drop for Pages<'_, A> {
    fn drop(&mut self) {
        for read in &self.reads {
            read.abort();
        }
    }
}

impl<A> std::fmt::Debug for Pages<'_, A> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pages")
            .field("job", &self.job)
            .field("total_rows", &self.total_rows)
            .field("scheduled", &self.scheduled)
            .field("reads_in_flight", &self.reads.len())
            .finish_non_exhaustive()
    }
}

impl<A: Api> Pages<'_, A> {
    /// The result's columns.
    pub fn schema(&self) -> &TableSchema {
        &self.schema
    }

    /// BigQuery's job id (for logs).
    pub fn job_id(&self) -> &str {
        &self.job.job_id
    }

    /// Bytes the query processed, once BigQuery reported it.
    pub fn bytes_processed(&self) -> Option<i64> {
        self.bytes_processed
    }

    /// Rows per page from the bytes per row seen so far (the first page: a few).
    pub fn rows_per_page(&self) -> u32 {
        let (rows, bytes) = self.sampled;
        if rows == 0 {
            return self.first_rows();
        }
        let per_row = (bytes / rows).max(1);
        u32::try_from(self.page_bytes / per_row)
            .unwrap_or(u32::MAX)
            .clamp(1, self.page_size)
    }

    /// Rows of the next range: the byte-sized page, but the first ranges ramp up from the first
    /// page (2x, 4x, ...) so the first commits do not wait for a whole large page to arrive.
    fn next_range_rows(&self) -> u64 {
        let ramp = u64::from(self.first_rows()) << (self.ranges + 1).min(20);
        u64::from(self.rows_per_page()).min(ramp).max(1)
    }

    fn first_rows(&self) -> u32 {
        self.page_size.min(FIRST_PAGE_ROWS)
    }

    /// The next page's rows (possibly empty), or None after the last page.
    pub async fn next_page(&mut self) -> Result<Option<Vec<TableRow>>, PagesError> {
        if let Some(rows) = self.pending.take() {
            self.learn(&rows);
            self.schedule();
            return Ok(Some(rows));
        }
        if self.total_rows.is_some() {
            self.schedule();
            let Some(read) = self.reads.pop_front() else {
                return Ok(None);
            };
            let rows = read.await.map_err(|e| {
                PagesError::Request(format!("reading a page of job {}: {e}", self.job.job_id))
            })??;
            self.learn(&rows);
            self.schedule();
            return Ok(Some(rows));
        }
        if self.done {
            return Ok(None);
        }
        let token = self.next_token.clone();
        let rows = self.rows_per_page();
        let response = poll_results(self.bq, &self.job, self.deadline, token, rows).await?;
        self.accept(response)?;
        let rows = self.pending.take();
        if let Some(rows) = &rows {
            self.learn(rows);
        }
        Ok(rows)
    }

    /// Starts row-range reads until `parallel_reads` are in flight or the result is covered.
    fn schedule(&mut self) {
        let Some(total) = self.total_rows else {
            return;
        };
        while self.reads.len() < self.parallel_reads && self.scheduled < total {
            let start = self.scheduled;
            let end = (start + self.next_range_rows()).min(total);
            self.scheduled = end;
            self.ranges += 1;
            let (bq, job, page_size) = (self.bq.clone(), self.job.clone(), self.page_size);
            self.reads.push_back(tokio::spawn(async move {
                read_range(&bq, job, start, end, page_size).await
            }));
        }
    }

    /// Learns the bytes per row on the wire from a few of `rows`.
    fn learn(&mut self, rows: &[TableRow]) {
        let step = (rows.len() / SAMPLED_ROWS).max(1);
        for row in rows.iter().step_by(step).take(SAMPLED_ROWS) {
            let bytes = serde_json::to_vec(row).map_or(0, |v| v.len());
            self.sampled.0 += 1;
            self.sampled.1 += bytes;
        }
    }

    /// Takes a complete answer: schema (first time), bytes, rows, total rows, next token.
    fn accept(&mut self, response: QueryResponse) -> Result<(), PagesError> {
        check_errors(response.errors.as_deref(), response.schema.as_ref())?;
        if let Some(schema) = response.schema {
            if self.schema.fields.is_none() {
                self.schema = schema;
            }
        } else if self.schema.fields.is_none() {
            return Err(PagesError::Request(format!(
                "job {} completed without a result schema",
                self.job.job_id
            )));
        }
        if let Some(bytes) = parse_bytes(response.total_bytes_processed.as_deref()) {
            self.bytes_processed = Some(bytes);
        }
        let rows = response.rows.unwrap_or_default();
        self.next_token = response.page_token.filter(|t| !t.is_empty());
        self.done = self.next_token.is_none();
        // Once BigQuery says how many rows there are, the rest is read by row ranges.
        self.scheduled += rows.len() as u64;
        let total = response.total_rows.as_deref().and_then(|t| t.parse().ok());
        if let Some(total) = total.filter(|&t: &u64| !self.done && t > self.scheduled) {
            self.total_rows = Some(total);
        }
        self.pending = Some(rows);
        Ok(())
    }
}

/// `getQueryResults` for one page, polling while the job is incomplete (until `deadline`).
async fn poll_results<A: Api>(
    bq: &BigQuery<A>,
    job: &Job,
    deadline: Instant,
    page_token: Option<String>,
    rows: u32,
) -> Result<QueryResponse, PagesError> {
    let mut pause = bq.timeouts.poll;
    loop {
        let params = results_params(job, rows, page_token.clone(), None);
        let response = get_results(bq, job, params).await?;
        if response.job_complete == Some(true) {
            return Ok(response);
        }
        check_errors(response.errors.as_deref(), None)?;
        if Instant::now() >= deadline {
            return Err(PagesError::Request(format!(
                "job {} did not complete within {:?}; raise --bigquery-job-timeout or make the query cheaper",
                job.job_id, bq.timeouts.job
            )));
        }
        tracing::debug!(job = %job.job_id, "The BigQuery job is still running.");
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(2));
    }
}

/// `getQueryResults` parameters for `rows` rows from a page token or a row index.
fn results_params(
    job: &Job,
    rows: u32,
    page_token: Option<String>,
    start_index: Option<u64>,
) -> GetQueryResultsParameters {
    GetQueryResultsParameters {
        format_options: Some(int64_timestamps()),
        location: job.location.clone(),
        max_results: Some(i32::try_from(rows).unwrap_or(i32::MAX)),
        page_token,
        start_index: start_index.map(|i| i.to_string()),
        timeout_ms: Some(SERVER_WAIT_MS),
    }
}

/// One `getQueryResults` call with its timeout and retries.
async fn get_results<A: Api>(
    bq: &BigQuery<A>,
    job: &Job,
    params: GetQueryResultsParameters,
) -> Result<QueryResponse, PagesError> {
    let response = bq
        .call("jobs.getQueryResults", || {
            bq.api
                .get_query_results(&bq.project, &job.job_id, params.clone())
        })
        .await?;
    Ok(response.into())
}

/// The rows `start..end` of a complete job's result; a short answer (BigQuery's byte cap) is
/// finished by further calls from where it stopped.
async fn read_range<A: Api>(
    bq: &BigQuery<A>,
    job: Job,
    start: u64,
    end: u64,
    page_size: u32,
) -> Result<Vec<TableRow>, PagesError> {
    let mut rows = Vec::with_capacity(usize::try_from(end - start).unwrap_or(0));
    let mut at = start;
    while at < end {
        let want = u32::try_from(end - at).unwrap_or(u32::MAX).min(page_size);
        let params = results_params(&job, want, None, Some(at));
        let response = get_results(bq, &job, params).await?;
        check_errors(response.errors.as_deref(), response.schema.as_ref())?;
        if response.job_complete != Some(true) {
            return Err(PagesError::Request(format!(
                "job {} answered rows {at}.. as incomplete after it had completed",
                job.job_id
            )));
        }
        let mut got = response.rows.unwrap_or_default();
        if got.is_empty() {
            return Err(PagesError::Request(format!(
                "job {} returned no rows at index {at} of a result it said has at least {end}; rerun the stream",
                job.job_id
            )));
        }
        got.truncate(usize::try_from(end - at).unwrap_or(usize::MAX));
        at += got.len() as u64;
        rows.append(&mut got);
    }
    Ok(rows)
}

/// Errors in a 200 answer fail the query when there is no usable result with them; otherwise
/// they are warnings (BigQuery may report warnings on a successful job).
fn check_errors(
    errors: Option<&[ErrorProto]>,
    schema: Option<&TableSchema>,
) -> Result<(), PagesError> {
    let errors = errors.unwrap_or_default();
    if errors.is_empty() {
        return Ok(());
    }
    let message = errors
        .iter()
        .map(|e| match (&e.reason, &e.message) {
            (Some(r), Some(m)) => format!("{m} ({r})"),
            (None, Some(m)) => m.clone(),
            (Some(r), None) => r.clone(),
            (None, None) => "unspecified error".to_owned(),
        })
        .collect::<Vec<_>>()
        .join("; ");
    if schema.is_some_and(|s| s.field_count() > 0) {
        tracing::warn!(warnings = %message, "BigQuery reported problems with a successful result; the result is used.");
        return Ok(());
    }
    Err(PagesError::Query(message))
}

/// `formatOptions.useInt64Timestamp = true`: TIMESTAMP cells as exact int64 microseconds.
fn int64_timestamps() -> DataFormatOptions {
    DataFormatOptions {
        use_int64_timestamp: Some(true),
    }
}

fn parse_bytes(text: Option<&str>) -> Option<i64> {
    text.and_then(|t| t.parse().ok())
}

fn request(spec: &QuerySpec) -> QueryRequest {
    let mut r = QueryRequest::new(spec.query.clone());
    r.use_legacy_sql = false;
    r.parameter_mode = Some("NAMED".into());
    r.query_parameters = Some(spec.params.clone());
    r.location = spec.location.clone();
    r.maximum_bytes_billed = spec.maximum_bytes_billed.map(|b| b.to_string());
    r.max_results =
        Some(i32::try_from(spec.page_size.clamp(1, FIRST_PAGE_ROWS)).unwrap_or(i32::MAX));
    r.timeout_ms = Some(SERVER_WAIT_MS);
    r.format_options = Some(int64_timestamps());
    // Makes a retried jobs.query idempotent on BigQuery's side (≤ 36 ASCII characters).
    r.request_id = Some(format!(
        "pubsub-outbox-{:016x}{:06x}",
        fastrand::u64(..),
        fastrand::u32(..0x100_0000)
    ));
    r
}

#[cfg(test)]
#[path = "pages_tests.rs"]
mod tests;
