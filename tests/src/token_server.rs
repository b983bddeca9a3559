//! A stand-in for Google's token endpoints, for the credential tests: the OAuth token endpoint
//! (`POST …/token`: an `authorized_user` refresh, or the source credentials of an impersonated
//! service account), the STS token exchange (`POST …/sts`: Workload Identity Federation's
//! `external_account`), IAM Credentials' `generateAccessToken` (impersonation) and the metadata
//! server's token (`GET /computeMetadata/v1/instance/service-accounts/default/token`, what a GKE
//! pod's Workload Identity reads through `GCE_METADATA_HOST`), which can answer 503 for a while
//! as GKE's does at pod start ([`TokenServer::metadata_unavailable_for`]). Each answers with a
//! fixed token naming its kind, in the shape the real endpoint uses, and every request is
//! recorded (request line, `Authorization`, body) so a test can check who asked for what.

use std::sync::{Arc, Mutex};

use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::task::AbortHandle;

use crate::http_faults::{header, read_request};

/// The token `POST …/token` returns.
pub const USER_TOKEN: &str = "stand-in-user-token";
/// The token the STS exchange returns.
pub const FEDERATED_TOKEN: &str = "stand-in-federated-token";
/// The token `generateAccessToken` returns.
pub const IMPERSONATED_TOKEN: &str = "stand-in-impersonated-token";
/// The token the metadata server returns.
pub const METADATA_TOKEN: &str = "stand-in-metadata-token";

/// One request the stand-in answered.
#[derive(Debug, Clone)]
pub struct TokenRequest {
    /// `POST /path HTTP/1.1`.
    pub request_line: String,
    /// Its `Authorization` header ("" when none).
    pub authorization: String,
    /// Its body (form-encoded or JSON).
    pub body: String,
}

/// A running stand-in; stops when dropped.
#[derive(Debug)]
pub struct TokenServer {
    base: String,
    requests: Arc<Mutex<Vec<TokenRequest>>>,
    issued: Arc<Mutex<Vec<Issued>>>,
    /// The metadata server answers 503 until then.
    metadata_down_until: Arc<Mutex<Option<std::time::Instant>>>,
    accept: AbortHandle,
}

/// A token `POST …/token` handed out by an expiring stand-in ([`TokenServer::start_expiring`]).
#[derive(Debug, Clone)]
pub struct Issued {
    /// `stand-in-user-token-N`.
    pub token: String,
    /// When it was handed out, and when it expires.
    pub at: std::time::Instant,
    pub expires: std::time::Instant,
}

impl TokenServer {
    /// Starts on a free loopback port; its tokens last an hour.
    pub async fn start() -> Self {
        Self::start_with(None).await
    }

    /// Starts on a free loopback port; `POST …/token` hands out a new token each time
    /// (`stand-in-user-token-1`, `-2`, …) that expires after `expires_in`, and records each
    /// ([`Self::issued`]).
    pub async fn start_expiring(expires_in: std::time::Duration) -> Self {
        Self::start_with(Some(expires_in)).await
    }

    async fn start_with(expiring: Option<std::time::Duration>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind a loopback port");
        let base = format!("http://{}", listener.local_addr().expect("bound address"));
        let requests: Arc<Mutex<Vec<TokenRequest>>> = Arc::default();
        let issued: Arc<Mutex<Vec<Issued>>> = Arc::default();
        let metadata_down_until: Arc<Mutex<Option<std::time::Instant>>> = Arc::default();
        let seen = requests.clone();
        let handed = issued.clone();
        let down = metadata_down_until.clone();
        let accept = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let seen = seen.clone();
                let handed = handed.clone();
                let down = down.clone();
                tokio::spawn(async move {
                    let Ok((head, body)) = read_request(&mut client).await else {
                        return;
                    };
                    let request_line = head.lines().next().unwrap_or_default().to_owned();
                    let path = request_line.split_whitespace().nth(1).unwrap_or_default();
                    let metadata = path.starts_with("/computeMetadata/v1/");
                    let metadata_down = metadata
                        && down
                            .lock()
                            .ok()
                            .and_then(|d| *d)
                            .is_some_and(|until| std::time::Instant::now() < until);
                    let answer = if metadata_down {
                        None
                    } else if metadata {
                        let flavored = header(&head, "metadata-flavor").as_deref() == Some("Google");
                        (flavored && path.contains("/service-accounts/default/token")).then(|| {
                            serde_json::json!({
                                "access_token": METADATA_TOKEN,
                                "expires_in": 3599,
                                "token_type": "Bearer",
                            })
                        })
                    } else if path.ends_with(":generateAccessToken") {
                        let expires = (chrono::Utc::now() + chrono::Duration::hours(1))
                            .to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
                        Some(serde_json::json!({"accessToken": IMPERSONATED_TOKEN, "expireTime": expires}))
                    } else if path.ends_with("/sts") {
                        Some(serde_json::json!({
                            "access_token": FEDERATED_TOKEN,
                            "issued_token_type": "urn:ietf:params:oauth:token-type:access_token",
                            "token_type": "Bearer",
                            "expires_in": 3600,
                        }))
                    } else if path.ends_with("/token") {
                        let (token, expires_in) = match expiring {
                            None => (USER_TOKEN.to_owned(), 3600),
                            Some(lasts) => {
                                let mut handed = match handed.lock() {
                                    Ok(h) => h,
                                    Err(poisoned) => poisoned.into_inner(),
                                };
                                let token = format!("{USER_TOKEN}-{}", handed.len() + 1);
                                let at = std::time::Instant::now();
                                handed.push(Issued {
                                    token: token.clone(),
                                    at,
                                    expires: at + lasts,
                                });
                                (token, lasts.as_secs())
                            }
                        };
                        Some(serde_json::json!({
                            "access_token": token,
                            "expires_in": expires_in,
                            "token_type": "Bearer",
                        }))
                    } else {
                        None
                    };
                    if let Ok(mut r) = seen.lock() {
                        r.push(TokenRequest {
                            authorization: header(&head, "authorization").unwrap_or_default(),
                            request_line,
                            body: String::from_utf8_lossy(&body).into_owned(),
                        });
                    }
                    let (status, body) = match answer {
                        Some(json) => ("200 OK", json.to_string()),
                        None if metadata_down => ("503 Service Unavailable", "{}".to_owned()),
                        None => ("404 Not Found", "{}".to_owned()),
                    };
                    let flavor = if metadata { "Metadata-Flavor: Google\r\n" } else { "" };
                    let response = format!(
                        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\n{flavor}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = client.write_all(response.as_bytes()).await;
                    let _ = client.shutdown().await;
                });
            }
        })
        .abort_handle();
        Self {
            base,
            requests,
            issued,
            metadata_down_until,
            accept,
        }
    }

    /// The metadata server answers 503 for `lasting` from now (as GKE's may at pod start), then
    /// tokens.
    pub fn metadata_unavailable_for(&self, lasting: std::time::Duration) {
        if let Ok(mut d) = self.metadata_down_until.lock() {
            *d = Some(std::time::Instant::now() + lasting);
        }
    }

    /// `host:port`, what `GCE_METADATA_HOST` takes.
    pub fn host(&self) -> &str {
        self.base.trim_start_matches("http://")
    }

    /// `http://127.0.0.1:<port><path>`.
    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// The tokens an expiring stand-in handed out, in order.
    pub fn issued(&self) -> Vec<Issued> {
        self.issued.lock().map(|i| i.clone()).unwrap_or_default()
    }

    /// Every request so far, in order.
    pub fn requests(&self) -> Vec<TokenRequest> {
        self.requests.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        self.accept.abort();
    }
}
