//! A stand-in for Google's token endpoints, for the credential tests: the OAuth token endpoint
//! (`POST …/token`: an `authorized_user` refresh, or the source credentials of an impersonated
//! service account), the STS token exchange (`POST …/sts`: Workload Identity Federation's
//! `external_account`) and IAM Credentials' `generateAccessToken` (impersonation). Each answers
//! with a fixed token naming its kind, in the shape the real endpoint uses, and every request is
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
        let seen = requests.clone();
        let handed = issued.clone();
        let accept = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let seen = seen.clone();
                let handed = handed.clone();
                tokio::spawn(async move {
                    let Ok((head, body)) = read_request(&mut client).await else {
                        return;
                    };
                    let request_line = head.lines().next().unwrap_or_default().to_owned();
                    let path = request_line.split_whitespace().nth(1).unwrap_or_default();
                    let answer = if path.ends_with(":generateAccessToken") {
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
                        None => ("404 Not Found", "{}".to_owned()),
                    };
                    let response = format!(
                        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
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
            accept,
        }
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
