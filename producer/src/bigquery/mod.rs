//! BigQuery access: the only code that calls `gcp-bigquery-client`.
//!
//! [`Api`] is the seam: the two REST calls the producer needs (`jobs.query`,
//! `jobs.getQueryResults`), implemented for the real client and faked in unit tests.
//! [`pages::Pages`] walks a query's result page by page on top of it (see there for polling,
//! retries and the memory bound). [`connect`] builds a client for production (Application Default
//! Credentials: a key file, `gcloud auth application-default login`, or the metadata server that
//! Cloud Run and GKE Workload Identity provide) or for an emulator (anonymous).

pub mod pages;

use std::future::Future;
use std::pin::Pin;

use gcp_bigquery_client::Client;
use gcp_bigquery_client::auth::Authenticator;
use gcp_bigquery_client::client_builder::ClientBuilder;
use gcp_bigquery_client::error::BQError;
use gcp_bigquery_client::model::get_query_results_parameters::GetQueryResultsParameters;
use gcp_bigquery_client::model::get_query_results_response::GetQueryResultsResponse;
use gcp_bigquery_client::model::query_parameter::QueryParameter;
use gcp_bigquery_client::model::query_parameter_type::QueryParameterType;
use gcp_bigquery_client::model::query_parameter_value::QueryParameterValue;
use gcp_bigquery_client::model::query_request::QueryRequest;
use gcp_bigquery_client::model::query_response::QueryResponse;

pub use pages::{BigQuery, Pages, QuerySpec, Timeouts};

/// The BigQuery REST calls the producer makes.
pub trait Api: Send + Sync {
    /// `jobs.query`: starts a query, returns its first page if it finished within the timeout.
    fn query(
        &self,
        project: &str,
        request: QueryRequest,
    ) -> impl Future<Output = Result<QueryResponse, ApiError>> + Send;
    /// `jobs.getQueryResults`: polls a job / reads one page of its result.
    fn get_query_results(
        &self,
        project: &str,
        job_id: &str,
        params: GetQueryResultsParameters,
    ) -> impl Future<Output = Result<GetQueryResultsResponse, ApiError>> + Send;
}

/// A failed BigQuery call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// What BigQuery (or the transport) said.
    pub message: String,
    /// Whether trying again may help.
    pub kind: ApiErrorKind,
}

/// How to react to an [`ApiError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApiErrorKind {
    /// BigQuery refused the request (bad query, permission, limit): retrying cannot help.
    Refused,
    /// Network, timeout, 429 or 5xx: retry with backoff.
    Transient,
    /// An answer we could not read.
    Other,
}

impl ApiError {
    /// A transient error with `message`.
    pub fn transient(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            kind: ApiErrorKind::Transient,
        }
    }

    /// A refusal with `message`.
    pub fn refused(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            kind: ApiErrorKind::Refused,
        }
    }
}

impl From<BQError> for ApiError {
    fn from(e: BQError) -> Self {
        match e {
            BQError::ResponseError { error } => {
                let e = error.error;
                let reasons: Vec<&str> = e
                    .errors
                    .iter()
                    .filter_map(|m| m.get("reason").map(String::as_str))
                    .collect();
                let transient = e.code == 429
                    || e.code >= 500
                    || reasons.iter().any(|r| {
                        matches!(*r, "backendError" | "rateLimitExceeded" | "internalError")
                    });
                let message = format!("{} (HTTP {}, {})", e.message, e.code, reasons.join(", "));
                let kind = if transient {
                    ApiErrorKind::Transient
                } else {
                    ApiErrorKind::Refused
                };
                Self { message, kind }
            }
            BQError::RequestError(r) => {
                let kind = if r.is_decode() {
                    ApiErrorKind::Other
                } else {
                    ApiErrorKind::Transient
                };
                Self {
                    message: error_chain(&r),
                    kind,
                }
            }
            other => Self {
                message: error_chain(&other),
                kind: ApiErrorKind::Other,
            },
        }
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

impl Api for Client {
    async fn query(&self, project: &str, request: QueryRequest) -> Result<QueryResponse, ApiError> {
        self.job()
            .query(project, request)
            .await
            .map_err(ApiError::from)
    }

    async fn get_query_results(
        &self,
        project: &str,
        job_id: &str,
        params: GetQueryResultsParameters,
    ) -> Result<GetQueryResultsResponse, ApiError> {
        self.job()
            .get_query_results(project, job_id, params)
            .await
            .map_err(ApiError::from)
    }
}

/// How the client authenticates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Credentials {
    /// Anonymous with an endpoint override (an emulator), else Application Default Credentials.
    #[default]
    Auto,
    /// Application Default Credentials (GOOGLE_APPLICATION_CREDENTIALS, gcloud, metadata server).
    Adc,
    /// No credentials (emulators only).
    Anonymous,
}

/// Builds a client. `endpoint` is a base URL such as `http://127.0.0.1:9050` (the REST v2 base is
/// `<endpoint>/bigquery/v2`); None means BigQuery itself.
pub async fn connect(endpoint: Option<&str>, credentials: Credentials) -> Result<Client, ApiError> {
    let mut builder = ClientBuilder::new();
    if let Some(endpoint) = endpoint {
        builder.with_v2_base_url(v2_base_url(endpoint));
    }
    let anonymous = match credentials {
        Credentials::Auto => endpoint.is_some(),
        Credentials::Adc => false,
        Credentials::Anonymous => true,
    };
    let client = if anonymous {
        builder
            .build_from_authenticator(std::sync::Arc::new(AnonymousAuthenticator))
            .await
    } else {
        builder.build_from_application_default_credentials().await
    };
    client.map_err(|e| ApiError {
        message: format!("building the BigQuery client: {}", error_chain(&e)),
        kind: ApiErrorKind::Other,
    })
}

/// `http://host:port` (scheme optional) → `http://host:port/bigquery/v2`.
pub fn v2_base_url(endpoint: &str) -> String {
    let base = endpoint.trim_end_matches('/');
    let base = if base.contains("://") {
        base.to_owned()
    } else {
        format!("http://{base}")
    };
    if base.ends_with("/bigquery/v2") {
        base
    } else {
        format!("{base}/bigquery/v2")
    }
}

/// An authenticator that sends a dummy token (emulators ignore it).
#[derive(Debug, Clone, Copy)]
pub struct AnonymousAuthenticator;

type TokenFuture<'a> = Pin<Box<dyn Future<Output = Result<String, BQError>> + Send + 'a>>;

// The trait is declared with `#[async_trait]`; this is the signature that macro expands to.
impl Authenticator for AnonymousAuthenticator {
    fn access_token<'life0, 'async_trait>(&'life0 self) -> TokenFuture<'async_trait>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(async { Ok("anonymous".to_owned()) })
    }
}

/// A named query parameter of a scalar type (`INT64`, `STRING`, …) with its value as text.
pub fn parameter(name: &str, r#type: &str, value: String) -> QueryParameter {
    QueryParameter {
        name: Some(name.to_owned()),
        parameter_type: Some(QueryParameterType {
            array_type: None,
            struct_types: None,
            r#type: r#type.to_owned(),
        }),
        parameter_value: Some(QueryParameterValue {
            array_values: None,
            struct_values: None,
            value: Some(value),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::v2_base_url;

    #[test]
    fn endpoints_become_the_v2_base_url() {
        assert_eq!(
            v2_base_url("http://127.0.0.1:9050"),
            "http://127.0.0.1:9050/bigquery/v2"
        );
        assert_eq!(
            v2_base_url("http://127.0.0.1:9050/"),
            "http://127.0.0.1:9050/bigquery/v2"
        );
        assert_eq!(
            v2_base_url("127.0.0.1:9050"),
            "http://127.0.0.1:9050/bigquery/v2"
        );
        assert_eq!(
            v2_base_url("https://bq.example/bigquery/v2"),
            "https://bq.example/bigquery/v2"
        );
    }
}
