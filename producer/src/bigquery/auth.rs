//! Credentials for BigQuery calls: anonymous (emulators) or Application Default Credentials.
//!
//! One [`Authenticator`] (gcp-bigquery-client's trait, the crate's seam for credentials) serves
//! both the crate's client and the producer's own two REST calls ([`super::rest`]). ADC comes from
//! `google-cloud-auth`, the OAuth stack the dispatcher's Pub/Sub client uses, so both binaries
//! accept the same credentials: the file named by `GOOGLE_APPLICATION_CREDENTIALS`, else gcloud's
//! `application_default_credentials.json`, of any type gcloud writes (`service_account`,
//! `authorized_user`, `impersonated_service_account` from
//! `gcloud auth application-default login --impersonate-service-account`, `external_account`
//! for Workload Identity Federation), else the metadata server (Cloud Run, GKE Workload
//! Identity, GCE). It caches tokens and refreshes them before they expire.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use gcp_bigquery_client::auth::Authenticator;
use gcp_bigquery_client::error::BQError;
use google_cloud_auth::credentials::{AccessTokenCredentials, Builder};

/// The OAuth scope of BigQuery jobs.
const SCOPE: &str = "https://www.googleapis.com/auth/bigquery";

type TokenFuture<'a> = Pin<Box<dyn Future<Output = Result<String, BQError>> + Send + 'a>>;

/// An authenticator that sends a dummy token (emulators ignore it).
#[derive(Debug, Clone, Copy)]
pub struct AnonymousAuthenticator;

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

/// Application Default Credentials (see the module doc).
#[derive(Clone)]
struct AdcAuthenticator(AccessTokenCredentials);

impl Authenticator for AdcAuthenticator {
    fn access_token<'life0, 'async_trait>(&'life0 self) -> TokenFuture<'async_trait>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(async move {
            // The crate's error type has no variant for another OAuth stack: carry the message.
            self.0.access_token().await.map(|t| t.token).map_err(|e| {
                BQError::InvalidApplicationDefaultCredentialsAuthenticator(std::io::Error::other(
                    e.to_string(),
                ))
            })
        })
    }
}

/// Builds the ADC authenticator; the error says what was tried. No token is fetched here: the
/// first call does (and says so when it fails).
pub(crate) async fn application_default() -> Result<Arc<dyn Authenticator>, String> {
    let credentials = Builder::default()
        .with_scopes([SCOPE])
        .build_access_token_credentials()
        .map_err(|e| {
            format!(
                "Application Default Credentials (GOOGLE_APPLICATION_CREDENTIALS, else gcloud's \
                 application_default_credentials.json, else the metadata server): {e}"
            )
        })?;
    Ok(Arc::new(AdcAuthenticator(credentials)))
}
