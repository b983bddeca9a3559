//! Ending a sidecar with the run. A Cloud Run Job's task ends when its containers have exited;
//! the Cloud SQL Auth Proxy beside the producer would otherwise keep the task alive until its
//! timeout (a failed, retried execution on every tick). Started with `--quitquitquit`, the proxy
//! exits on `POST /quitquitquit` to its admin port; `--sidecar-quit-url` names that URL and the
//! producer calls it exactly once as it exits, whatever the outcome: success, failure, a
//! configuration error found after start-up, or a signal.

use std::time::Duration;

use crate::errors::ConfigError;

/// How long the call may take: the proxy answers at once on loopback; a sidecar that does not
/// must not hold the exit (the platform's own timeout ends it then).
const QUIT_TIMEOUT: Duration = Duration::from_secs(3);

/// The sidecar's quit endpoint.
#[derive(Debug, Clone)]
pub struct SidecarQuit {
    url: reqwest::Url,
}

impl SidecarQuit {
    /// Checks `url` (an http:// or https:// URL).
    pub fn new(url: &str) -> Result<Self, ConfigError> {
        let bad = |why: String| {
            ConfigError::flag(
                "--sidecar-quit-url (OUTBOX_SIDECAR_QUIT_URL)",
                vec![format!(
                    "{why}: give the sidecar's quit endpoint, e.g. http://127.0.0.1:9091/quitquitquit \
                     for a Cloud SQL Auth Proxy started with --quitquitquit --admin-port=9091, or \
                     leave it unset"
                )],
            )
        };
        let parsed =
            reqwest::Url::parse(url).map_err(|e| bad(format!("{url:?} is not a URL ({e})")))?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(bad(format!("{url:?} is not an http:// or https:// URL")));
        }
        Ok(Self { url: parsed })
    }

    /// POSTs to the endpoint once. A failure is logged, never fatal: the run's outcome stands.
    pub async fn quit(&self) {
        let client = match reqwest::Client::builder().timeout(QUIT_TIMEOUT).build() {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(url = %self.url, error = %e, "Could not build the HTTP client to stop the sidecar; the platform's timeout will end it.");
                return;
            }
        };
        match client.post(self.url.clone()).send().await {
            Ok(r) if r.status().is_success() => {
                tracing::info!(url = %self.url, "Asked the sidecar to exit.");
            }
            Ok(r) => tracing::warn!(
                url = %self.url,
                status = r.status().as_u16(),
                "The sidecar refused to exit; check its --quitquitquit flag and admin port."
            ),
            Err(e) => tracing::warn!(
                url = %self.url,
                error = %e,
                "Could not reach the sidecar to stop it; check --sidecar-quit-url and its admin port."
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_http_urls_are_accepted() {
        assert!(SidecarQuit::new("http://127.0.0.1:9091/quitquitquit").is_ok());
        assert!(SidecarQuit::new("https://localhost/quit").is_ok());
        for bad in ["127.0.0.1:9091/quitquitquit", "ftp://x/quit", ""] {
            let e = SidecarQuit::new(bad).expect_err(bad);
            assert!(e.problems[0].contains("quitquitquit"), "{e:?}");
        }
    }
}
