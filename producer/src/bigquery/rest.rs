//! The two REST calls the producer makes, sent by the producer itself: `jobs.query` and
//! `jobs.getQueryResults`.
//!
//! Why not through gcp-bigquery-client (still used for auth, the request/response types and
//! everything else): it cannot send `formatOptions` on getQueryResults (its query-string encoder
//! fails with "builder error" on the nested field), so TIMESTAMPs of later pages would come back
//! as float seconds and lose microseconds after 2242; and it decodes every non-2xx body as
//! BigQuery's error JSON, so an HTML 502 from a front end or a 503 without the legacy `errors`
//! array becomes a decode error with the HTTP status lost. Here every answer is classified by
//! [`classify`]: HTTP status first, body second.

use std::sync::Arc;

use gcp_bigquery_client::auth::Authenticator;
use gcp_bigquery_client::model::get_query_results_parameters::GetQueryResultsParameters;
use gcp_bigquery_client::model::get_query_results_response::GetQueryResultsResponse;
use gcp_bigquery_client::model::query_request::QueryRequest;
use gcp_bigquery_client::model::query_response::QueryResponse;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::{Api, ApiError, ApiErrorKind, error_chain};

/// BigQuery's REST API at a base URL (`…/bigquery/v2`), with one authenticator.
#[derive(Clone)]
pub struct Rest {
    http: reqwest::Client,
    auth: Arc<dyn Authenticator>,
    base: reqwest::Url,
}

impl std::fmt::Debug for Rest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Rest({})", self.base)
    }
}

impl Rest {
    /// Calls under `base` (e.g. `https://bigquery.googleapis.com/bigquery/v2`) with `auth`.
    pub fn new(
        http: reqwest::Client,
        auth: Arc<dyn Authenticator>,
        base: &str,
    ) -> Result<Self, ApiError> {
        let base = reqwest::Url::parse(base).map_err(|e| ApiError {
            message: format!("the BigQuery endpoint {base:?} is not a URL: {e}"),
            kind: ApiErrorKind::Other,
        })?;
        if base.cannot_be_a_base() {
            return Err(ApiError {
                message: format!("the BigQuery endpoint {base} cannot be a base URL"),
                kind: ApiErrorKind::Other,
            });
        }
        Ok(Self { http, auth, base })
    }

    /// `<base>/projects/<project>/queries[/<job>]`, each segment percent-encoded.
    fn url(&self, project: &str, job_id: Option<&str>) -> reqwest::Url {
        let mut url = self.base.clone();
        if let Ok(mut segments) = url.path_segments_mut() {
            segments
                .pop_if_empty()
                .extend(["projects", project, "queries"]);
            if let Some(job) = job_id {
                segments.push(job);
            }
        }
        url
    }

    async fn send<T: DeserializeOwned>(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<T, ApiError> {
        let token = self.auth.access_token().await.map_err(|e| ApiError {
            message: format!(
                "getting a BigQuery access token: {}. Check --bigquery-credentials and GOOGLE_APPLICATION_CREDENTIALS",
                error_chain(&e)
            ),
            kind: ApiErrorKind::Transient,
        })?;
        let response = request
            .bearer_auth(token)
            .send()
            .await
            .map_err(|e| ApiError::transient(error_chain(&e)))?;
        let status = response.status().as_u16();
        let body = response.bytes().await.map_err(|e| {
            ApiError::transient(format!(
                "HTTP {status}, reading the body: {}",
                error_chain(&e)
            ))
        })?;
        if (200..300).contains(&status) {
            return serde_json::from_slice(&body).map_err(|e| {
                ApiError::transient(format!(
                    "HTTP {status} with an unreadable body ({e}): {}",
                    snippet(&body)
                ))
            });
        }
        Err(classify(status, &body))
    }
}

impl Api for Rest {
    async fn query(&self, project: &str, request: QueryRequest) -> Result<QueryResponse, ApiError> {
        let url = self.url(project, None);
        self.send(self.http.post(url).json(&request)).await
    }

    async fn get_query_results(
        &self,
        project: &str,
        job_id: &str,
        params: GetQueryResultsParameters,
    ) -> Result<GetQueryResultsResponse, ApiError> {
        let mut url = self.url(project, Some(job_id));
        {
            let mut q = url.query_pairs_mut();
            if let Some(int64) = params.format_options.and_then(|f| f.use_int64_timestamp) {
                q.append_pair("formatOptions.useInt64Timestamp", &int64.to_string());
            }
            if let Some(location) = &params.location {
                q.append_pair("location", location);
            }
            if let Some(n) = params.max_results {
                q.append_pair("maxResults", &n.to_string());
            }
            if let Some(token) = &params.page_token {
                q.append_pair("pageToken", token);
            }
            if let Some(start) = &params.start_index {
                q.append_pair("startIndex", start);
            }
            if let Some(ms) = params.timeout_ms {
                q.append_pair("timeoutMs", &ms.to_string());
            }
        }
        self.send(self.http.get(url)).await
    }
}

/// A non-2xx answer, classified by HTTP status first and body second:
/// - 429, every 5xx, and any status whose body is not BigQuery's error JSON (a proxy's HTML page):
///   transient, retried with backoff;
/// - a 4xx with a readable reason: permanent, unless the reason is one BigQuery documents as
///   retryable (`rateLimitExceeded` comes as 403, `backendError`, `internalError`); the message
///   says what the user must fix.
pub fn classify(status: u16, body: &[u8]) -> ApiError {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    let error = parsed.as_ref().and_then(|v| v.get("error"));
    let message = error
        .and_then(|e| e.get("message"))
        .and_then(Value::as_str)
        .filter(|m| !m.is_empty());
    let reasons: Vec<&str> = error
        .and_then(|e| e.get("errors"))
        .and_then(Value::as_array)
        .map(|errors| {
            errors
                .iter()
                .filter_map(|e| e.get("reason").and_then(Value::as_str))
                .collect()
        })
        .unwrap_or_default();
    let described = match message {
        Some(m) if reasons.is_empty() => format!("{m} (HTTP {status})"),
        Some(m) => format!("{m} (HTTP {status}, {})", reasons.join(", ")),
        None => format!("HTTP {status} without a readable error: {}", snippet(body)),
    };
    let retryable_reason = reasons
        .iter()
        .any(|r| matches!(*r, "backendError" | "rateLimitExceeded" | "internalError"));
    if status == 429 || status >= 500 || message.is_none() || retryable_reason {
        return ApiError::transient(described);
    }
    let fix = match status {
        400 => "fix the stream's query, its parameters or maximum_bytes_billed",
        401 => {
            "the credentials were refused: check --bigquery-credentials and GOOGLE_APPLICATION_CREDENTIALS"
        }
        403 => {
            "grant the job's identity roles/bigquery.jobUser on the project and read access to the tables"
        }
        404 => "check the project, dataset and table names and the stream's location",
        _ => "fix the request and rerun",
    };
    ApiError::refused(format!("{described}; {fix}"))
}

/// The start of a body, one line, for messages.
fn snippet(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let line: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut cut: String = line.chars().take(160).collect();
    if cut.len() < line.len() {
        cut.push('…');
    }
    if cut.is_empty() {
        "(empty body)".to_owned()
    } else {
        cut
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_5xx_429_and_unreadable_body_is_transient() {
        let html =
            b"<html><head><title>502 Bad Gateway</title></head><body>bad gateway</body></html>";
        let bare_503 = br#"{"error": {"code": 503, "message": "The service is currently unavailable.", "status": "UNAVAILABLE"}}"#;
        let cases: Vec<(u16, &[u8])> = vec![
            (502, html),
            (503, bare_503),
            (500, b""),
            (504, b"upstream request timeout"),
            (429, br#"{"error": {"code": 429, "message": "Too many requests"}}"#),
            (403, br#"{"error": {"code": 403, "message": "Exceeded rate limits", "errors": [{"reason": "rateLimitExceeded"}]}}"#),
            (404, b"<html>not found</html>"),
        ];
        for (status, body) in cases {
            let e = classify(status, body);
            assert_eq!(e.kind, ApiErrorKind::Transient, "HTTP {status}: {e}");
            assert!(e.message.contains(&format!("HTTP {status}")), "{e}");
        }
        assert!(
            classify(503, bare_503)
                .message
                .contains("currently unavailable")
        );
        assert!(classify(502, html).message.contains("502 Bad Gateway"));
    }

    #[test]
    fn a_4xx_with_a_readable_reason_is_permanent_and_says_what_to_fix() {
        let body = br#"{"error": {"code": 400, "message": "Unrecognized name: nope at [1:8]", "errors": [{"reason": "invalidQuery", "message": "Unrecognized name: nope at [1:8]"}], "status": "INVALID_ARGUMENT"}}"#;
        let e = classify(400, body);
        assert_eq!(e.kind, ApiErrorKind::Refused);
        assert!(
            e.message.contains("Unrecognized name: nope")
                && e.message.contains("invalidQuery")
                && e.message.contains("fix the stream's query"),
            "{e}"
        );
        let denied = br#"{"error": {"code": 403, "message": "Access Denied: Project p", "status": "PERMISSION_DENIED"}}"#;
        let e = classify(403, denied);
        assert_eq!(e.kind, ApiErrorKind::Refused);
        assert!(e.message.contains("roles/bigquery.jobUser"), "{e}");
    }

    #[test]
    fn urls_encode_each_segment_under_the_base() {
        let rest = Rest::new(
            reqwest::Client::new(),
            Arc::new(super::super::AnonymousAuthenticator),
            "http://127.0.0.1:9050/bigquery/v2",
        )
        .expect("a base URL");
        assert_eq!(
            rest.url("example.com:p", Some("job/1")).as_str(),
            "http://127.0.0.1:9050/bigquery/v2/projects/example.com:p/queries/job%2F1"
        );
        assert_eq!(
            rest.url("p", None).as_str(),
            "http://127.0.0.1:9050/bigquery/v2/projects/p/queries"
        );
    }
}
