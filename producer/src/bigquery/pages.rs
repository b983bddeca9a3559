//! One query's result, page by page: `jobs.query`, then `jobs.getQueryResults` with page tokens.
//!
//! - Memory: at most one page is held (`maxResults` = the page size; BigQuery also caps a page
//!   at ~10 MB), whatever the result size.
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
use gcp_bigquery_client::model::data_format_options::DataFormatOptions;
use gcp_bigquery_client::model::error_proto::ErrorProto;
use gcp_bigquery_client::model::get_query_results_parameters::GetQueryResultsParameters;
use gcp_bigquery_client::model::query_parameter::QueryParameter;
use gcp_bigquery_client::model::query_request::QueryRequest;
use gcp_bigquery_client::model::query_response::QueryResponse;
use gcp_bigquery_client::model::table_row::TableRow;
use gcp_bigquery_client::model::table_schema::TableSchema;

use super::{Api, ApiError, ApiErrorKind};

/// Server-side wait per `jobs.query` / `getQueryResults` call while a job runs.
const SERVER_WAIT_MS: i32 = 10_000;

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
    /// Rows per page (`maxResults`).
    pub page_size: u32,
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
            job_id,
            location,
            page_size: spec.page_size,
            deadline: started + self.timeouts.job,
            schema: TableSchema::default(),
            bytes_processed: None,
            pending: None,
            next_token: None,
            done: false,
        };
        if first.job_complete == Some(true) {
            pages.accept(first)?;
        } else {
            let response = pages.fetch(None).await?;
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

/// A running or finished query's result, read page by page.
#[derive(Debug)]
pub struct Pages<'a, A> {
    bq: &'a BigQuery<A>,
    job_id: String,
    location: Option<String>,
    page_size: u32,
    deadline: Instant,
    schema: TableSchema,
    bytes_processed: Option<i64>,
    pending: Option<Vec<TableRow>>,
    next_token: Option<String>,
    done: bool,
}

impl<A: Api> Pages<'_, A> {
    /// The result's columns.
    pub fn schema(&self) -> &TableSchema {
        &self.schema
    }

    /// BigQuery's job id (for logs).
    pub fn job_id(&self) -> &str {
        &self.job_id
    }

    /// Bytes the query processed, once BigQuery reported it.
    pub fn bytes_processed(&self) -> Option<i64> {
        self.bytes_processed
    }

    /// The next page's rows (possibly empty), or None after the last page.
    pub async fn next_page(&mut self) -> Result<Option<Vec<TableRow>>, PagesError> {
        if let Some(rows) = self.pending.take() {
            return Ok(Some(rows));
        }
        if self.done {
            return Ok(None);
        }
        let token = self.next_token.clone();
        let response = self.fetch(token).await?;
        self.accept(response)?;
        Ok(self.pending.take())
    }

    /// `getQueryResults` for one page, polling while the job is incomplete.
    async fn fetch(&self, page_token: Option<String>) -> Result<QueryResponse, PagesError> {
        let mut pause = self.bq.timeouts.poll;
        loop {
            let params = GetQueryResultsParameters {
                format_options: Some(int64_timestamps()),
                location: self.location.clone(),
                max_results: Some(i32::try_from(self.page_size).unwrap_or(i32::MAX)),
                page_token: page_token.clone(),
                start_index: None,
                timeout_ms: Some(SERVER_WAIT_MS),
            };
            let bq = self.bq;
            let response: QueryResponse = bq
                .call("jobs.getQueryResults", || {
                    bq.api
                        .get_query_results(&bq.project, &self.job_id, params.clone())
                })
                .await?
                .into();
            if response.job_complete == Some(true) {
                return Ok(response);
            }
            check_errors(response.errors.as_deref(), None)?;
            if Instant::now() >= self.deadline {
                return Err(PagesError::Request(format!(
                    "job {} did not complete within {:?}; raise --bigquery-job-timeout or make the query cheaper",
                    self.job_id, self.bq.timeouts.job
                )));
            }
            tracing::debug!(job = %self.job_id, "The BigQuery job is still running.");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(2));
        }
    }

    /// Takes a complete answer: schema (first time), bytes, rows, next token.
    fn accept(&mut self, response: QueryResponse) -> Result<(), PagesError> {
        check_errors(response.errors.as_deref(), response.schema.as_ref())?;
        if let Some(schema) = response.schema {
            if self.schema.fields.is_none() {
                self.schema = schema;
            }
        } else if self.schema.fields.is_none() {
            return Err(PagesError::Request(format!(
                "job {} completed without a result schema",
                self.job_id
            )));
        }
        if let Some(bytes) = parse_bytes(response.total_bytes_processed.as_deref()) {
            self.bytes_processed = Some(bytes);
        }
        self.pending = Some(response.rows.unwrap_or_default());
        self.next_token = response.page_token.filter(|t| !t.is_empty());
        self.done = self.next_token.is_none();
        Ok(())
    }
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
    r.max_results = Some(i32::try_from(spec.page_size).unwrap_or(i32::MAX));
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
