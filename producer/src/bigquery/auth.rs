//! Credentials for BigQuery calls: anonymous (emulators) or Application Default Credentials.
//!
//! One [`Authenticator`] (gcp-bigquery-client's trait) serves both the crate's client and the
//! producer's own two REST calls ([`super::rest`]). ADC, in order: the file named by
//! `GOOGLE_APPLICATION_CREDENTIALS` (a service account key or `authorized_user` credentials),
//! gcloud's `application_default_credentials.json` (`gcloud auth application-default login`),
//! else the metadata server (Cloud Run, GKE Workload Identity, GCE). Tokens come from
//! `yup-oauth2`, the crate's own OAuth library (re-exported by it), which caches and refreshes them.

use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;

use gcp_bigquery_client::auth::Authenticator;
use gcp_bigquery_client::error::BQError;
use gcp_bigquery_client::yup_oauth2::authenticator::{
    ApplicationDefaultCredentialsTypes, DefaultAuthenticator,
};
use gcp_bigquery_client::yup_oauth2::{
    self, ApplicationDefaultCredentialsAuthenticator, ApplicationDefaultCredentialsFlowOpts,
    AuthorizedUserAuthenticator,
};

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
struct AdcAuthenticator(DefaultAuthenticator);

impl Authenticator for AdcAuthenticator {
    fn access_token<'life0, 'async_trait>(&'life0 self) -> TokenFuture<'async_trait>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(async move {
            let token = self.0.token(&[SCOPE]).await?;
            token.token().map(str::to_owned).ok_or(BQError::NoToken)
        })
    }
}

/// Builds the ADC authenticator; the error says what was tried.
pub(crate) async fn application_default() -> Result<Arc<dyn Authenticator>, String> {
    let file = std::env::var_os("GOOGLE_APPLICATION_CREDENTIALS")
        .map(PathBuf::from)
        .or_else(|| {
            let home = std::env::var_os("HOME")?;
            let path =
                PathBuf::from(home).join(".config/gcloud/application_default_credentials.json");
            path.exists().then_some(path)
        });
    if let Some(path) = &file
        && is_authorized_user(path).await
    {
        let secret = yup_oauth2::read_authorized_user_secret(path)
            .await
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        let auth = AuthorizedUserAuthenticator::builder(secret)
            .build()
            .await
            .map_err(|e| format!("authorized_user credentials {}: {e}", path.display()))?;
        return Ok(Arc::new(AdcAuthenticator(auth)));
    }
    let opts = ApplicationDefaultCredentialsFlowOpts::default();
    let built = match ApplicationDefaultCredentialsAuthenticator::builder(opts).await {
        ApplicationDefaultCredentialsTypes::ServiceAccount(b) => b.build().await,
        ApplicationDefaultCredentialsTypes::InstanceMetadata(b) => b.build().await,
    };
    let auth = built.map_err(|e| format!("Application Default Credentials: {e}"))?;
    Ok(Arc::new(AdcAuthenticator(auth)))
}

/// Whether `path` holds gcloud's `authorized_user` credentials (rather than a service account key).
async fn is_authorized_user(path: &PathBuf) -> bool {
    let Ok(text) = tokio::fs::read_to_string(path).await else {
        return false;
    };
    serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| {
            v.get("type")
                .and_then(|t| t.as_str())
                .map(|t| t == "authorized_user")
        })
        .unwrap_or(false)
}
