//! Cross-site request forgery: every form that changes something carries a token bound to the
//! identity (an HMAC of it under a key of the console's), and every change checks it, as well as
//! the browser's own word on where the request came from (`Sec-Fetch-Site`, `Origin`). A page
//! of another site can make a browser send the identity's cookies or IAP session, never the token.

use aws_lc_rs::hmac;
use aws_lc_rs::rand::{SecureRandom, SystemRandom};
use axum::http::HeaderMap;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

/// Mints and checks the tokens.
#[derive(Debug)]
pub struct Csrf {
    key: hmac::Key,
}

impl Csrf {
    /// Tokens under `secret` (shared by the replicas of a console), or a random key of this
    /// process's own when there is none.
    pub fn new(secret: Option<&str>) -> Self {
        let mut random = [0u8; 32];
        let bytes: &[u8] = match secret.filter(|s| !s.is_empty()) {
            Some(s) => s.as_bytes(),
            None => {
                // An all-zero key if the OS has no randomness to give: tokens still bind the
                // identity, only a forger who knows that could mint them.
                let _ = SystemRandom::new().fill(&mut random);
                &random
            }
        };
        Self {
            key: hmac::Key::new(hmac::HMAC_SHA256, bytes),
        }
    }

    /// The token of `identity`.
    pub fn token(&self, identity: &str) -> String {
        URL_SAFE_NO_PAD.encode(hmac::sign(&self.key, identity.as_bytes()).as_ref())
    }

    /// Whether `token` is `identity`'s (compared in constant time).
    pub fn check(&self, identity: &str, token: &str) -> bool {
        URL_SAFE_NO_PAD
            .decode(token)
            .is_ok_and(|tag| hmac::verify(&self.key, identity.as_bytes(), &tag).is_ok())
    }
}

/// Whether the browser says the request came from another site: `Sec-Fetch-Site` other than
/// `same-origin` or `none`, or an `Origin` whose host is not the request's `Host`.
pub fn cross_site(headers: &HeaderMap) -> bool {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if let Some(site) = text("sec-fetch-site")
        && site != "same-origin"
        && site != "none"
    {
        return true;
    }
    match (text("origin"), text("host")) {
        (Some(origin), Some(host)) => {
            let origin_host = origin.split_once("://").map_or(origin, |(_, h)| h);
            origin_host != host
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    #[test]
    fn a_token_is_bound_to_its_identity_and_key() {
        let csrf = Csrf::new(Some("shared secret"));
        let token = csrf.token("alice@example.com");
        assert!(csrf.check("alice@example.com", &token));
        assert!(!csrf.check("mallory@example.com", &token));
        assert!(!csrf.check("alice@example.com", ""));
        assert!(!csrf.check("alice@example.com", "not base64 ***"));
        assert!(!Csrf::new(None).check("alice@example.com", &token));
        assert_eq!(
            Csrf::new(Some("shared secret")).token("alice@example.com"),
            token,
            "replicas sharing the secret accept each other's tokens"
        );
    }

    #[test]
    fn requests_from_another_site_are_told_apart() {
        let headers = |pairs: &[(&'static str, &'static str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.insert(*k, HeaderValue::from_static(v));
            }
            h
        };
        assert!(!cross_site(&headers(&[])));
        assert!(!cross_site(&headers(&[("sec-fetch-site", "same-origin")])));
        assert!(cross_site(&headers(&[("sec-fetch-site", "cross-site")])));
        assert!(!cross_site(&headers(&[
            ("origin", "https://console.example.com"),
            ("host", "console.example.com")
        ])));
        assert!(cross_site(&headers(&[
            ("origin", "https://evil.example"),
            ("host", "console.example.com")
        ])));
        // What a sandboxed frame (or a page under no-referrer) sends: not this origin.
        assert!(cross_site(&headers(&[
            ("origin", "null"),
            ("host", "console.example.com")
        ])));
    }
}
