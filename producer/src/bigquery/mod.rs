//! BigQuery access: the only code that calls `gcp-bigquery-client`.
//!
//! [`Api`] is the seam: the two REST calls the producer needs (`jobs.query`,
//! `jobs.getQueryResults`), sent by [`rest::Rest`] (why not by the crate: see there) and faked in
//! unit tests. [`pages::Pages`] walks a query's result page by page on top of it (see there for
//! polling, retries and the memory bound). [`connect`] builds the API for production
//! (Application Default Credentials, [`auth`]) or for an emulator (anonymous); [`client`] builds
//! gcp-bigquery-client's client on the same credentials for everything else (the test harness
//! creates datasets and tables with it).

pub mod auth;
pub mod pages;
pub mod rest;

use std::future::Future;
use std::sync::Arc;

use gcp_bigquery_client::Client;
use gcp_bigquery_client::auth::Authenticator;
use gcp_bigquery_client::client_builder::ClientBuilder;
use gcp_bigquery_client::model::get_query_results_parameters::GetQueryResultsParameters;
use gcp_bigquery_client::model::get_query_results_response::GetQueryResultsResponse;
use gcp_bigquery_client::model::query_parameter::QueryParameter;
use gcp_bigquery_client::model::query_parameter_type::QueryParameterType;
use gcp_bigquery_client::model::query_parameter_value::QueryParameterValue;
use gcp_bigquery_client::model::query_request::QueryRequest;
use gcp_bigquery_client::model::query_response::QueryResponse;

pub use auth::AnonymousAuthenticator;
pub use pages::{BigQuery, Pages, QuerySpec, Timeouts};
pub use rest::Rest;

/// The BigQuery REST calls the producer makes. Cloned into the tasks that read pages ahead
/// (cheap: [`Rest`] shares its HTTP client).
pub trait Api: Send + Sync + Clone + 'static {
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
    /// Network, timeout, 429, 5xx, or an answer we could not read: retry with backoff.
    Transient,
    /// A local problem (an unusable endpoint, credentials that cannot be built).
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

pub(crate) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

/// How the client authenticates.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Credentials {
    /// Anonymous with a plain-HTTP endpoint override (an emulator), else Application Default
    /// Credentials (BigQuery itself, or any https endpoint such as a regional one).
    #[default]
    Auto,
    /// Application Default Credentials (GOOGLE_APPLICATION_CREDENTIALS, gcloud, metadata server).
    Adc,
    /// No credentials (emulators only).
    Anonymous,
}

impl Credentials {
    /// Whether calls to `endpoint` (None: BigQuery itself) go without credentials.
    pub fn is_anonymous(self, endpoint: Option<&str>) -> bool {
        match self {
            Self::Auto => endpoint.is_some_and(|e| !v2_base_url(e).starts_with("https://")),
            Self::Adc => false,
            Self::Anonymous => true,
        }
    }
}

/// The BigQuery REST v2 base URL for `endpoint` (None: BigQuery itself).
fn base_url(endpoint: Option<&str>) -> String {
    endpoint.map_or_else(
        || "https://bigquery.googleapis.com/bigquery/v2".to_owned(),
        v2_base_url,
    )
}

async fn authenticator(
    endpoint: Option<&str>,
    credentials: Credentials,
) -> Result<Arc<dyn Authenticator>, ApiError> {
    if credentials.is_anonymous(endpoint) {
        return Ok(Arc::new(AnonymousAuthenticator));
    }
    auth::application_default().await.map_err(|e| ApiError {
        message: format!("building the BigQuery credentials: {e}"),
        kind: ApiErrorKind::Other,
    })
}

/// Builds the producer's BigQuery API. `endpoint` is a base URL such as `http://127.0.0.1:9050`
/// (the REST v2 base is `<endpoint>/bigquery/v2`); None means BigQuery itself.
pub async fn connect(endpoint: Option<&str>, credentials: Credentials) -> Result<Rest, ApiError> {
    let auth = authenticator(endpoint, credentials).await?;
    Rest::new(reqwest::Client::new(), auth, &base_url(endpoint))
}

/// gcp-bigquery-client's client at `endpoint` with the same credentials as [`connect`].
pub async fn client(endpoint: Option<&str>, credentials: Credentials) -> Result<Client, ApiError> {
    let auth = authenticator(endpoint, credentials).await?;
    ClientBuilder::new()
        .with_v2_base_url(base_url(endpoint))
        .build_from_authenticator(auth)
        .await
        .map_err(|e| ApiError {
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
