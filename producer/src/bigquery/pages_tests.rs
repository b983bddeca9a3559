//! The paging loop against a scripted fake of the two REST calls.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use gcp_bigquery_client::model::get_query_results_response::GetQueryResultsResponse;
use gcp_bigquery_client::model::job_reference::JobReference;
use gcp_bigquery_client::model::table_cell::TableCell;
use gcp_bigquery_client::model::table_field_schema::TableFieldSchema;
use serde_json::json;

use super::*;

/// Answers calls from a script, recording the page tokens it was asked for.
#[derive(Default, Clone)]
struct Fake {
    query: Arc<Mutex<VecDeque<Result<QueryResponse, ApiError>>>>,
    results: Arc<Mutex<VecDeque<Result<GetQueryResultsResponse, ApiError>>>>,
    tokens_asked: Arc<Mutex<Vec<Option<String>>>>,
    results_params: Arc<Mutex<Vec<GetQueryResultsParameters>>>,
    requests: Arc<Mutex<Vec<QueryRequest>>>,
}

impl Api for Fake {
    async fn query(
        &self,
        _project: &str,
        request: QueryRequest,
    ) -> Result<QueryResponse, ApiError> {
        self.requests.lock().expect("lock").push(request);
        self.query
            .lock()
            .expect("lock")
            .pop_front()
            .expect("an unscripted jobs.query call")
    }

    async fn get_query_results(
        &self,
        _project: &str,
        _job_id: &str,
        params: GetQueryResultsParameters,
    ) -> Result<GetQueryResultsResponse, ApiError> {
        self.tokens_asked
            .lock()
            .expect("lock")
            .push(params.page_token.clone());
        self.results_params.lock().expect("lock").push(params);
        self.results
            .lock()
            .expect("lock")
            .pop_front()
            .expect("an unscripted getQueryResults call")
    }
}

fn schema() -> TableSchema {
    TableSchema::new(vec![TableFieldSchema::integer("id")])
}

fn rows(ids: &[i64]) -> Vec<TableRow> {
    ids.iter()
        .map(|i| TableRow {
            columns: Some(vec![TableCell {
                value: Some(json!(i.to_string())),
            }]),
        })
        .collect()
}

fn job() -> Option<JobReference> {
    Some(JobReference {
        job_id: Some("job_1".into()),
        location: Some("EU".into()),
        project_id: None,
    })
}

fn complete(ids: &[i64], token: Option<&str>) -> GetQueryResultsResponse {
    GetQueryResultsResponse {
        job_complete: Some(true),
        job_reference: job(),
        schema: Some(schema()),
        rows: Some(rows(ids)),
        page_token: token.map(str::to_owned),
        total_bytes_processed: Some("1234".into()),
        ..Default::default()
    }
}

fn incomplete() -> GetQueryResultsResponse {
    GetQueryResultsResponse {
        job_complete: Some(false),
        job_reference: job(),
        ..Default::default()
    }
}

fn spec() -> QuerySpec {
    QuerySpec {
        query: "SELECT 1".into(),
        params: vec![],
        location: None,
        maximum_bytes_billed: None,
        page_size: 2,
        page_bytes: 4 << 20,
        parallel_reads: 4,
    }
}

fn fast() -> Timeouts {
    Timeouts {
        request: Duration::from_secs(5),
        job: Duration::from_secs(5),
        poll: Duration::from_millis(1),
        retries: 3,
    }
}

async fn collect(bq: &BigQuery<Fake>) -> Result<(Vec<Vec<i64>>, Option<i64>), PagesError> {
    let mut pages = bq.open(&spec()).await?;
    let mut out = Vec::new();
    while let Some(page) = pages.next_page().await? {
        out.push(
            page.iter()
                .map(|r| {
                    r.columns.as_ref().expect("cells")[0]
                        .value
                        .as_ref()
                        .expect("v")
                        .as_str()
                        .expect("s")
                        .parse()
                        .expect("i64")
                })
                .collect(),
        );
    }
    Ok((out, pages.bytes_processed()))
}

#[tokio::test]
async fn pages_are_read_in_order_following_page_tokens() {
    let fake = Fake::default();
    fake.query
        .lock()
        .expect("lock")
        .push_back(Ok(complete(&[1, 2], Some("t2")).into()));
    fake.results
        .lock()
        .expect("lock")
        .extend([Ok(complete(&[3, 4], Some("t3"))), Ok(complete(&[5], None))]);
    let bq = BigQuery::new(fake, "p", fast());
    let (pages, bytes) = collect(&bq).await.expect("all pages read");
    assert_eq!(pages, vec![vec![1, 2], vec![3, 4], vec![5]]);
    let query = serde_json::to_value(&bq.api.requests.lock().expect("lock")[0]).expect("json");
    assert_eq!(
        query["formatOptions"],
        json!({"useInt64Timestamp": true}),
        "jobs.query asks for exact timestamps"
    );
    for params in bq.api.results_params.lock().expect("lock").iter() {
        assert_eq!(
            params
                .format_options
                .as_ref()
                .and_then(|f| f.use_int64_timestamp),
            Some(true),
            "every getQueryResults page asks for exact timestamps"
        );
    }
    assert_eq!(bytes, Some(1234));
    assert_eq!(
        *bq.api.tokens_asked.lock().expect("lock"),
        vec![Some("t2".to_owned()), Some("t3".to_owned())]
    );
}

#[tokio::test]
async fn an_incomplete_job_is_polled_until_it_completes() {
    let fake = Fake::default();
    let pending: QueryResponse = incomplete().into();
    fake.query.lock().expect("lock").push_back(Ok(pending));
    fake.results.lock().expect("lock").extend([
        Ok(incomplete()),
        Ok(incomplete()),
        Ok(complete(&[7], None)),
    ]);
    let bq = BigQuery::new(fake, "p", fast());
    let (pages, _) = collect(&bq).await.expect("result read after polling");
    assert_eq!(pages, vec![vec![7]]);
    assert_eq!(
        bq.api.tokens_asked.lock().expect("lock").len(),
        3,
        "polled until complete, no page token yet"
    );
}

#[tokio::test]
async fn transient_failures_are_retried_and_refusals_are_not() {
    let fake = Fake::default();
    fake.query
        .lock()
        .expect("lock")
        .push_back(Ok(complete(&[1], Some("t2")).into()));
    fake.results
        .lock()
        .expect("lock")
        .extend([Err(ApiError::transient("503")), Ok(complete(&[2], None))]);
    let bq = BigQuery::new(fake, "p", fast());
    assert_eq!(
        collect(&bq).await.expect("retried").0,
        vec![vec![1], vec![2]]
    );

    let fake = Fake::default();
    fake.query
        .lock()
        .expect("lock")
        .push_back(Err(ApiError::refused("Syntax error")));
    let bq = BigQuery::new(fake, "p", fast());
    assert_eq!(
        collect(&bq).await.expect_err("refused"),
        PagesError::Query("Syntax error".into())
    );
}

#[tokio::test]
async fn errors_inside_a_successful_answer_fail_the_query() {
    let fake = Fake::default();
    let failed = QueryResponse {
        job_complete: Some(true),
        job_reference: job(),
        schema: Some(TableSchema::new(vec![])),
        rows: Some(vec![]),
        errors: Some(vec![ErrorProto {
            reason: Some("invalidQuery".into()),
            message: Some("Unrecognized name: nope".into()),
            ..Default::default()
        }]),
        ..Default::default()
    };
    fake.query.lock().expect("lock").push_back(Ok(failed));
    let bq = BigQuery::new(fake, "p", fast());
    assert_eq!(
        collect(&bq).await.expect_err("query error"),
        PagesError::Query("Unrecognized name: nope (invalidQuery)".into())
    );
}

#[tokio::test]
async fn a_job_that_never_completes_times_out() {
    let fake = Fake::default();
    fake.query
        .lock()
        .expect("lock")
        .push_back(Ok(incomplete().into()));
    fake.results
        .lock()
        .expect("lock")
        .extend((0..1000).map(|_| Ok(incomplete())));
    let timeouts = Timeouts {
        job: Duration::from_millis(30),
        ..fast()
    };
    let bq = BigQuery::new(fake, "p", timeouts);
    let err = collect(&bq).await.expect_err("times out");
    assert!(
        matches!(&err, PagesError::Request(m) if m.contains("did not complete")),
        "{err}"
    );
}

#[tokio::test]
async fn the_query_carries_its_parameters_cost_guard_and_page_size() {
    let fake = Fake::default();
    fake.query
        .lock()
        .expect("lock")
        .push_back(Ok(complete(&[1], None).into()));
    let bq = BigQuery::new(fake, "p", fast());
    let spec = QuerySpec {
        query: "SELECT @watermark_ts, @watermark_key".into(),
        params: vec![
            super::super::parameter("watermark_ts", "INT64", "5".into()),
            super::super::parameter("watermark_key", "STRING", "k".into()),
        ],
        location: Some("EU".into()),
        maximum_bytes_billed: Some(1_000_000),
        page_size: 250,
        ..spec()
    };
    let mut pages = bq.open(&spec).await.expect("opens");
    while pages.next_page().await.expect("page").is_some() {}
    let sent = bq.api.requests.lock().expect("lock");
    let body = serde_json::to_value(&sent[0]).expect("serialises");
    assert_eq!(body["maximumBytesBilled"], json!("1000000"));
    assert_eq!(body["maxResults"], json!(250));
    assert_eq!(body["location"], json!("EU"));
    assert_eq!(body["useLegacySql"], json!(false));
    assert_eq!(body["parameterMode"], json!("NAMED"));
    assert_eq!(
        body["queryParameters"],
        json!([
            {"name": "watermark_ts", "parameterType": {"type": "INT64"}, "parameterValue": {"value": "5"}},
            {"name": "watermark_key", "parameterType": {"type": "STRING"}, "parameterValue": {"value": "k"}}
        ])
    );
    assert!(
        body["requestId"].as_str().is_some_and(|id| id.len() <= 36),
        "an idempotency id of at most 36 chars"
    );
}

/// A result of `total` rows (ids 1..=total) answered like BigQuery: at most `maxResults` rows and
/// at most `cap` rows per answer (its byte cap), `totalRows` always, from `startIndex` or a page
/// token (a row offset here). Records each getQueryResults call's (startIndex, pageToken,
/// maxResults).
#[derive(Clone)]
struct Ranges {
    total: usize,
    cap: usize,
    asked: Arc<Mutex<Vec<Asked>>>,
}

/// What one getQueryResults call asked for: (startIndex, pageToken, maxResults).
type Asked = (Option<String>, Option<String>, Option<i32>);

impl Ranges {
    fn new(total: usize, cap: usize) -> Self {
        Self {
            total,
            cap,
            asked: Arc::default(),
        }
    }

    fn answer(&self, start: usize, max: Option<i32>) -> GetQueryResultsResponse {
        let max = max.map_or(usize::MAX, |m| usize::try_from(m).expect("positive"));
        let end = (start + max.min(self.cap)).min(self.total);
        let ids: Vec<i64> = (start + 1..=end).map(|i| i as i64).collect();
        let token = (end < self.total).then(|| end.to_string());
        GetQueryResultsResponse {
            total_rows: Some(self.total.to_string()),
            ..complete(&ids, token.as_deref())
        }
    }
}

impl Api for Ranges {
    async fn query(
        &self,
        _project: &str,
        request: QueryRequest,
    ) -> Result<QueryResponse, ApiError> {
        Ok(self.answer(0, request.max_results).into())
    }

    async fn get_query_results(
        &self,
        _project: &str,
        _job_id: &str,
        params: GetQueryResultsParameters,
    ) -> Result<GetQueryResultsResponse, ApiError> {
        self.asked.lock().expect("lock").push((
            params.start_index.clone(),
            params.page_token.clone(),
            params.max_results,
        ));
        let start = params
            .start_index
            .or(params.page_token)
            .map_or(0, |i| i.parse().expect("a row offset"));
        Ok(self.answer(start, params.max_results))
    }
}

async fn read_all(bq: &BigQuery<Ranges>, spec: &QuerySpec) -> Vec<Vec<i64>> {
    let mut pages = bq.open(spec).await.expect("opens");
    let mut out = Vec::new();
    while let Some(page) = pages.next_page().await.expect("page") {
        out.push(
            page.iter()
                .map(|r| {
                    r.columns.as_ref().expect("cells")[0]
                        .value
                        .as_ref()
                        .and_then(|v| v.as_str())
                        .expect("s")
                        .parse()
                        .expect("i64")
                })
                .collect(),
        );
    }
    out
}

#[tokio::test]
async fn row_ranges_read_in_parallel_come_back_in_order_and_short_answers_are_finished() {
    let bq = BigQuery::new(Ranges::new(23, 3), "p", fast());
    let spec = QuerySpec {
        page_size: 5,
        parallel_reads: 3,
        ..spec()
    };
    let pages = read_all(&bq, &spec).await;
    let rows: Vec<i64> = pages.iter().flatten().copied().collect();
    assert_eq!(
        rows,
        (1..=23).collect::<Vec<_>>(),
        "every row once, in order"
    );
    assert_eq!(
        pages[0],
        vec![1, 2, 3],
        "the first page as jobs.query answered it"
    );
    assert!(
        pages[1..]
            .iter()
            .all(|p| p.len() == 5 || p == &vec![19, 20, 21, 22, 23]),
        "ranges of 5 rows, each finished after BigQuery cut it at 3: {pages:?}"
    );
    let asked = bq.api().asked.lock().expect("lock").clone();
    assert!(
        asked
            .iter()
            .all(|(start, token, _)| start.is_some() && token.is_none()),
        "every page after the first is a row range, none follows a token: {asked:?}"
    );
}

#[tokio::test]
async fn pages_are_sized_by_the_bytes_of_the_rows_seen() {
    let bq = BigQuery::new(Ranges::new(200, 1_000), "p", fast());
    // A row here is about 18 bytes on the wire (`{"f":[{"v":"123"}]}`): ~10 rows per 180 bytes.
    let spec = QuerySpec {
        page_size: 50,
        page_bytes: 180,
        parallel_reads: 2,
        ..spec()
    };
    let pages = read_all(&bq, &spec).await;
    assert_eq!(pages.iter().map(Vec::len).sum::<usize>(), 200);
    assert_eq!(
        pages[0].len(),
        50,
        "the first page: at most --page-size rows"
    );
    let asked = bq.api().asked.lock().expect("lock").clone();
    assert!(
        asked
            .iter()
            .all(|(_, _, max)| max.is_some_and(|m| (8..=12).contains(&m))),
        "later pages ask for about page_bytes / row bytes rows: {asked:?}"
    );
}

#[tokio::test]
async fn the_first_ranges_ramp_up_to_the_page_size() {
    let bq = BigQuery::new(Ranges::new(30_000, 100_000), "p", fast());
    // ~18 bytes a row: pages of ~8,000 rows by bytes; the first page has 1,000.
    let spec = QuerySpec {
        page_size: 50_000,
        page_bytes: 18 * 8_000,
        parallel_reads: 4,
        ..spec()
    };
    let pages = read_all(&bq, &spec).await;
    let rows: Vec<i64> = pages.iter().flatten().copied().collect();
    assert_eq!(
        rows,
        (1..=30_000).collect::<Vec<_>>(),
        "every row once, in order"
    );
    let sizes: Vec<usize> = pages.iter().map(Vec::len).collect();
    assert_eq!(&sizes[..3], &[1_000, 2_000, 4_000], "ramped: {sizes:?}");
    assert!(
        sizes[3..sizes.len() - 1]
            .iter()
            .all(|&n| (6_000..=10_000).contains(&n)),
        "then pages sized by bytes: {sizes:?}"
    );
}
