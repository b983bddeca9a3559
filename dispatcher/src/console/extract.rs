//! The extractors every page and action takes: [`Who`] (the request's identity, or the
//! refusal: 401, or 503 when the proxy's keys cannot be read) and [`Change`] (a `POST
//! /actions/...`: the identity, the form's fields and ids, once the actions are on, the
//! request is same-origin and the CSRF token is the identity's).

use std::sync::Arc;

use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;

use super::auth::AuthError;
use super::state::Console;
use super::{csrf, fields, html};

impl Console {
    /// The identity of the request, or the refusal to send.
    async fn identify(&self, headers: &HeaderMap) -> Result<String, Response> {
        self.auth.identify(headers).await.map_err(|e| {
            tracing::info!(error = %e, "A console request was refused: no valid identity.");
            let status = match e {
                AuthError::Keys { .. } => StatusCode::SERVICE_UNAVAILABLE,
                _ => StatusCode::UNAUTHORIZED,
            };
            html::respond(status, "text/plain; charset=utf-8", format!("{e}\n"))
        })
    }

    /// A change request's form fields and ids, once the actions are on, the request is
    /// same-origin and the CSRF token is `who`'s.
    fn change_request(
        &self,
        who: &str,
        headers: &HeaderMap,
        body: &str,
    ) -> Result<(fields::Fields, Vec<String>), Box<Response>> {
        if !self.actions {
            return Err(Box::new(html::problem(
                StatusCode::FORBIDDEN,
                who,
                &format!(
                    "this console only reads: start it with --actions to pause, resume, {}",
                    crate::ops::change::VERBS
                        .iter()
                        .map(|v| v.action.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )));
        }
        let mut fields = fields::Fields::new();
        let mut ids = Vec::new();
        for (k, v) in form_urlencoded::parse(body.as_bytes()) {
            if k == "id" {
                ids.push(v.into_owned());
            } else {
                fields.insert(k.into_owned(), v.into_owned());
            }
        }
        let token = fields.get("csrf").map_or("", String::as_str);
        let refused = if csrf::cross_site(headers) {
            Some(
                "refused: the request came from another site (its Origin or Sec-Fetch-Site is not \
                 this console): a change is made only from the console's own pages",
            )
        } else if !self.csrf.check(who, token) {
            Some(
                "refused: the form's token is missing or not yours (reload the page and try again)",
            )
        } else {
            None
        };
        if let Some(why) = refused {
            tracing::warn!(identity = %who, refused = why, "A console change was refused.");
            return Err(Box::new(html::problem(StatusCode::FORBIDDEN, who, why)));
        }
        Ok((fields, ids))
    }
}

/// The identity of a request: every page and action takes it, and a request without a valid
/// one gets the refusal [`Console::identify`] gives.
pub struct Who(pub String);

impl FromRequestParts<Arc<Console>> for Who {
    type Rejection = Response;

    async fn from_request_parts(
        parts: &mut Parts,
        console: &Arc<Console>,
    ) -> Result<Self, Self::Rejection> {
        console.identify(&parts.headers).await.map(Who)
    }
}

/// A change (`POST /actions/...`): the identity, the form's fields and its ids, once the
/// actions are on, the request is same-origin and the CSRF token is the identity's
/// ([`Console::change_request`]); anything else gets the refusal as its response.
pub struct Change {
    /// Who asks.
    pub who: String,
    /// The form's fields but the ids.
    pub fields: fields::Fields,
    /// The form's `id` fields.
    pub ids: Vec<String>,
}

/// The most a change's form may hold (axum's own limit for a body read as text).
const FORM_LIMIT: usize = 2 * 1024 * 1024;

impl FromRequest<Arc<Console>> for Change {
    type Rejection = Response;

    async fn from_request(req: Request, console: &Arc<Console>) -> Result<Self, Self::Rejection> {
        let (mut parts, body) = req.into_parts();
        let Who(who) = Who::from_request_parts(&mut parts, console).await?;
        let body = axum::body::to_bytes(body, FORM_LIMIT)
            .await
            .ok()
            .and_then(|b| String::from_utf8(b.to_vec()).ok())
            .ok_or_else(|| {
                html::problem(
                    StatusCode::BAD_REQUEST,
                    &who,
                    "the form could not be read (over 2 MiB, or not UTF-8)",
                )
            })?;
        let (fields, ids) = console
            .change_request(&who, &parts.headers, &body)
            .map_err(|r| *r)?;
        Ok(Self { who, fields, ids })
    }
}
