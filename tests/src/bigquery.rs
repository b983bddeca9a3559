//! bqemulator helpers: a client on the emulator, a dataset + table per test, row inserts.
//!
//! bqemulator (DuckDB underneath) as used here, measured:
//! - rows sent with `insertAll` are visible to queries at once;
//! - TIMESTAMP cells come back as integer microseconds (`useInt64Timestamp` is ignored);
//! - a failed query is a 200 answer with `errors` (real BigQuery answers 4xx);
//! - BIGNUMERIC *columns* cannot be created (DuckDB decimals stop at 38 digits), BIGNUMERIC
//!   literals up to 38 digits work in queries; GEOGRAPHY needs the spatial extension (absent);
//! - JSON columns must be inserted as JSON *text* (an object is stored as its Python repr);
//! - a column named like a reserved word (`by`) silently empties `SELECT *`: avoid such names.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use gcp_bigquery_client::Client;
use gcp_bigquery_client::model::dataset::Dataset;
use gcp_bigquery_client::model::get_query_results_parameters::GetQueryResultsParameters;
use gcp_bigquery_client::model::get_query_results_response::GetQueryResultsResponse;
use gcp_bigquery_client::model::query_request::QueryRequest;
use gcp_bigquery_client::model::query_response::QueryResponse;
use gcp_bigquery_client::model::table::Table;
use gcp_bigquery_client::model::table_data_insert_all_request::TableDataInsertAllRequest;
use gcp_bigquery_client::model::table_field_schema::TableFieldSchema;
use gcp_bigquery_client::model::table_schema::TableSchema;
use outbox_producer::bigquery::{self, Api, ApiError, Credentials, Rest};

use crate::env;

/// gcp-bigquery-client's client on the emulator (anonymous credentials), for tables and rows.
pub async fn client() -> Client {
    bigquery::client(Some(&env::bigquery_emulator_host()), Credentials::Anonymous)
        .await
        .expect("a BigQuery client for the emulator builds")
}

/// The producer's BigQuery API on `endpoint` (anonymous credentials).
pub async fn api_at(endpoint: &str) -> Rest {
    bigquery::connect(Some(endpoint), Credentials::Anonymous)
        .await
        .expect("the producer's BigQuery API for the emulator builds")
}

/// The producer's BigQuery API on the emulator.
pub async fn api() -> Rest {
    api_at(&env::bigquery_emulator_host()).await
}

/// A dataset with one table, created for one test and deleted on drop.
#[derive(Clone)]
pub struct TestTable {
    /// The client used to create and fill the table.
    pub client: Client,
    /// The producer's BigQuery API on the same emulator.
    pub api: Rest,
    /// Project id.
    pub project: String,
    /// Dataset id (unique per test).
    pub dataset: String,
    /// Table id.
    pub table: String,
}

impl std::fmt::Debug for TestTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TestTable({})", self.name())
    }
}

impl TestTable {
    /// Creates a fresh dataset and a table `t` with `fields`.
    pub async fn create(fields: Vec<TableFieldSchema>) -> Self {
        let client = client().await;
        let project = env::bigquery_project();
        let dataset = env::unique_name("ds");
        client
            .dataset()
            .create(Dataset::new(&project, &dataset))
            .await
            .expect("bqemulator creates the dataset (run `scripts/services up`)");
        let table = "t".to_owned();
        client
            .table()
            .create(Table::new(
                &project,
                &dataset,
                &table,
                TableSchema::new(fields),
            ))
            .await
            .expect("bqemulator creates the table");
        Self {
            client,
            api: api().await,
            project,
            dataset,
            table,
        }
    }

    /// `project.dataset.table`, backquoted for GoogleSQL.
    pub fn name(&self) -> String {
        format!("`{}.{}.{}`", self.project, self.dataset, self.table)
    }

    /// Inserts rows (JSON objects keyed by column) with `insertAll`; panics on any insert error.
    pub async fn insert(&self, rows: &[serde_json::Value]) {
        if let Err(e) = self.try_insert(rows).await {
            panic!("{e:#}");
        }
    }

    /// Inserts rows (JSON objects keyed by column) with `insertAll`, 5,000 per request; an
    /// error names what failed (the soak's and the chaos run's feeders, which report it).
    pub async fn try_insert(&self, rows: &[serde_json::Value]) -> anyhow::Result<()> {
        for chunk in rows.chunks(5_000) {
            let mut request = TableDataInsertAllRequest::new();
            for row in chunk {
                request
                    .add_row(None, row.clone())
                    .map_err(|e| anyhow::anyhow!("a BigQuery row does not serialise: {e}"))?;
            }
            let response = self
                .client
                .tabledata()
                .insert_all(&self.project, &self.dataset, &self.table, request)
                .await
                .map_err(|e| anyhow::anyhow!("insertAll into bqemulator: {e}"))?;
            if let Some(errors) = response.insert_errors.filter(|e| !e.is_empty()) {
                anyhow::bail!("bqemulator refused rows: {errors:?}");
            }
        }
        Ok(())
    }

    /// Runs a query (e.g. DML) on the emulator and returns the answer; panics on an error.
    pub async fn query(&self, sql: &str) -> QueryResponse {
        let response = self
            .client
            .job()
            .query(&self.project, QueryRequest::new(sql))
            .await
            .expect("jobs.query answers");
        assert!(
            response.errors.as_deref().unwrap_or_default().is_empty(),
            "query {sql:?} failed: {:?}",
            response.errors
        );
        response
    }
}

impl Drop for TestTable {
    fn drop(&mut self) {
        // A fresh client on a private runtime: the test's client keeps pooled connections whose
        // tasks live on the test runtime, which this blocking drop would deadlock.
        let (project, dataset) = (self.project.clone(), self.dataset.clone());
        crate::detached::block_on_detached(move || async move {
            let _ = client()
                .await
                .dataset()
                .delete_if_exists(&project, &dataset, true)
                .await;
        });
    }
}

/// A BigQuery API that answers like `inner` for the rows before `row`, then refuses every call
/// asking for rows from there on (`startIndex` or a bqemulator page token, which is a row
/// offset): a run through it fails right after committing the pages before `row`, as a crash
/// would, however many pages it reads at once. Counts the calls that asked for rows.
#[derive(Debug, Clone)]
pub struct FailFromRow<A> {
    inner: A,
    row: u64,
    calls: Arc<AtomicUsize>,
}

impl<A> FailFromRow<A> {
    /// Serves the rows before `row` from `inner`, then fails.
    pub fn new(inner: A, row: u64) -> Self {
        Self {
            inner,
            row,
            calls: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// The refusal every call for a row at or after `row` gets.
    pub fn message(&self) -> String {
        format!("injected failure from row {}", self.row)
    }

    /// getQueryResults calls so far.
    pub fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

impl<A: Api> Api for FailFromRow<A> {
    async fn query(&self, project: &str, request: QueryRequest) -> Result<QueryResponse, ApiError> {
        if self.row == 0 {
            return Err(ApiError::refused(self.message()));
        }
        self.inner.query(project, request).await
    }

    async fn get_query_results(
        &self,
        project: &str,
        job_id: &str,
        params: GetQueryResultsParameters,
    ) -> Result<GetQueryResultsResponse, ApiError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let at = params
            .start_index
            .as_deref()
            .or(params.page_token.as_deref())
            .and_then(|i| i.parse::<u64>().ok())
            .unwrap_or(0);
        if at >= self.row {
            return Err(ApiError::refused(self.message()));
        }
        self.inner.get_query_results(project, job_id, params).await
    }
}
