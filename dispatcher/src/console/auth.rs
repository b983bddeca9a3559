//! Who is asking. Behind Google's Identity-Aware Proxy (`--auth iap`) every request carries the
//! proxy's signed assertion (`x-goog-iap-jwt-assertion`): an ES256 JWT, checked here against
//! Google's public keys (`--iap-keys-url`, fetched and cached), the audience of the console's
//! backend service (`--iap-audience`), the issuer and the expiry; its `email` is the identity.
//! A request without a valid one is refused. In local mode (`--auth local`, loopback only) the
//! identity is the operator who started the console.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use aws_lc_rs::signature::{ECDSA_P256_SHA256_FIXED, UnparsedPublicKey};
use axum::http::HeaderMap;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::Deserialize;
use tokio::sync::RwLock;

/// The header IAP adds to every request it lets through.
pub const IAP_HEADER: &str = "x-goog-iap-jwt-assertion";
/// The issuer of IAP's assertions.
pub const IAP_ISSUER: &str = "https://cloud.google.com/iap";
/// Clock skew tolerated on `exp` and `iat`.
const SKEW_SECONDS: i64 = 30;
/// How long fetched keys are trusted before they are fetched again.
const KEYS_FOR: Duration = Duration::from_secs(3600);
/// An unknown key id fetches the keys again, at most this often.
const REFETCH_AFTER: Duration = Duration::from_secs(30);

/// Why a request has no identity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No assertion header.
    #[error(
        "no {IAP_HEADER} header: the console only answers requests that came through Identity-Aware Proxy"
    )]
    Missing,
    /// The assertion is not a well-formed ES256 JWT.
    #[error("the IAP assertion is malformed: {0}")]
    Malformed(String),
    /// Signed by no key Google publishes, or the signature does not match.
    #[error("the IAP assertion's signature does not verify")]
    Signature,
    /// A claim is wrong: audience, issuer, expiry, email.
    #[error("the IAP assertion is not valid here: {0}")]
    Claims(String),
    /// Google's keys could not be fetched.
    #[error("Google's IAP keys could not be fetched from {url}: {reason}")]
    Keys {
        /// Where from.
        url: String,
        /// What went wrong.
        reason: String,
    },
}

/// The claims of an IAP assertion the console reads.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Claims {
    /// The user's email: the identity.
    pub email: String,
    /// The backend service the proxy signed for.
    pub aud: String,
    /// Who signed.
    pub iss: String,
    /// Expiry (seconds since the epoch).
    pub exp: i64,
    /// Issued at (seconds since the epoch).
    pub iat: i64,
}

#[derive(Debug, Deserialize)]
struct Header {
    alg: String,
    kid: String,
}

/// Public keys by key id: the uncompressed P-256 points (`04 || x || y`).
pub type Keys = HashMap<String, Vec<u8>>;

/// Checks `token` (an IAP assertion) against `keys`, `audience` and `now` (seconds since the
/// epoch); returns its claims.
pub fn verify(token: &str, keys: &Keys, audience: &str, now: i64) -> Result<Claims, AuthError> {
    let mut parts = token.split('.');
    let (Some(header), Some(payload), Some(signature), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(AuthError::Malformed("not three dot-separated parts".into()));
    };
    let decode = |part: &str, what: &str| {
        URL_SAFE_NO_PAD
            .decode(part)
            .map_err(|e| AuthError::Malformed(format!("{what} is not base64url: {e}")))
    };
    let head: Header = serde_json::from_slice(&decode(header, "the header")?)
        .map_err(|e| AuthError::Malformed(format!("the header: {e}")))?;
    if head.alg != "ES256" {
        return Err(AuthError::Malformed(format!(
            "algorithm {} (IAP signs with ES256)",
            head.alg
        )));
    }
    let key = keys.get(&head.kid).ok_or(AuthError::Signature)?;
    let signed = &token[..header.len() + 1 + payload.len()];
    UnparsedPublicKey::new(&ECDSA_P256_SHA256_FIXED, key)
        .verify(signed.as_bytes(), &decode(signature, "the signature")?)
        .map_err(|_| AuthError::Signature)?;
    let claims: Claims = serde_json::from_slice(&decode(payload, "the payload")?)
        .map_err(|e| AuthError::Malformed(format!("the payload: {e}")))?;
    if claims.iss != IAP_ISSUER {
        return Err(AuthError::Claims(format!("issuer {:?}", claims.iss)));
    }
    if claims.aud != audience {
        return Err(AuthError::Claims(format!(
            "audience {:?} (this console is {audience:?})",
            claims.aud
        )));
    }
    if claims.exp + SKEW_SECONDS < now {
        return Err(AuthError::Claims("expired".into()));
    }
    if claims.iat - SKEW_SECONDS > now {
        return Err(AuthError::Claims("issued in the future".into()));
    }
    if claims.email.trim().is_empty() {
        return Err(AuthError::Claims("no email".into()));
    }
    Ok(claims)
}

/// Parses a JWK set (`{"keys": [{"kty": "EC", "crv": "P-256", "kid", "x", "y"}, …]}`); keys of
/// another type are left out.
pub fn parse_keys(jwks: &[u8]) -> Result<Keys, String> {
    #[derive(Deserialize)]
    struct Set {
        keys: Vec<Jwk>,
    }
    #[derive(Deserialize)]
    struct Jwk {
        kid: String,
        kty: String,
        #[serde(default)]
        crv: String,
        #[serde(default)]
        x: String,
        #[serde(default)]
        y: String,
    }
    let set: Set = serde_json::from_slice(jwks).map_err(|e| format!("not a JWK set: {e}"))?;
    let mut keys = Keys::new();
    for k in set.keys {
        if k.kty != "EC" || k.crv != "P-256" {
            continue;
        }
        let (Ok(x), Ok(y)) = (URL_SAFE_NO_PAD.decode(&k.x), URL_SAFE_NO_PAD.decode(&k.y)) else {
            return Err(format!("key {} has malformed coordinates", k.kid));
        };
        if x.len() != 32 || y.len() != 32 {
            return Err(format!("key {} is not a P-256 point", k.kid));
        }
        let mut point = Vec::with_capacity(65);
        point.push(4);
        point.extend(x);
        point.extend(y);
        keys.insert(k.kid, point);
    }
    if keys.is_empty() {
        return Err("no P-256 key in the set".into());
    }
    Ok(keys)
}

/// How the console knows who asks.
#[derive(Debug)]
pub enum Auth {
    /// The operator who started it (loopback only).
    Local {
        /// The identity shown and audited.
        user: String,
    },
    /// Behind Identity-Aware Proxy.
    Iap(Iap),
}

/// IAP's verification state: the audience and the cached keys.
#[derive(Debug)]
pub struct Iap {
    audience: String,
    url: String,
    client: reqwest_auth::Client,
    keys: RwLock<Option<(Instant, Keys)>>,
}

impl Iap {
    /// Verification for `audience`, keys from `url` (fetched on first use).
    pub fn new(audience: String, url: String) -> Self {
        Self {
            audience,
            url,
            client: reqwest_auth::Client::builder()
                .timeout(Duration::from_secs(10))
                .build()
                .unwrap_or_default(),
            keys: RwLock::new(None),
        }
    }

    /// The keys, fetched when none are cached, when they are old, or (`unknown_kid`) when an
    /// assertion names a key they lack and the last fetch is older than [`REFETCH_AFTER`].
    async fn keys(&self, unknown_kid: bool) -> Result<Keys, AuthError> {
        if let Some((at, keys)) = self.keys.read().await.as_ref() {
            let stale = at.elapsed() > KEYS_FOR || (unknown_kid && at.elapsed() > REFETCH_AFTER);
            if !stale {
                return Ok(keys.clone());
            }
        }
        let failed = |reason: String| AuthError::Keys {
            url: self.url.clone(),
            reason,
        };
        let body = self
            .client
            .get(&self.url)
            .send()
            .await
            .and_then(reqwest_auth::Response::error_for_status)
            .map_err(|e| failed(e.to_string()))?
            .bytes()
            .await
            .map_err(|e| failed(e.to_string()))?;
        let keys = parse_keys(&body).map_err(failed)?;
        *self.keys.write().await = Some((Instant::now(), keys.clone()));
        Ok(keys)
    }

    async fn identify(&self, headers: &HeaderMap) -> Result<String, AuthError> {
        let token = headers
            .get(IAP_HEADER)
            .and_then(|v| v.to_str().ok())
            .ok_or(AuthError::Missing)?;
        let now = chrono::Utc::now().timestamp();
        let keys = self.keys(false).await?;
        let claims = match verify(token, &keys, &self.audience, now) {
            // A key Google added since the last fetch: fetch again once.
            Err(AuthError::Signature) => {
                verify(token, &self.keys(true).await?, &self.audience, now)
            }
            other => other,
        }?;
        Ok(claims.email)
    }
}

impl Auth {
    /// The identity of the request with these headers.
    pub async fn identify(&self, headers: &HeaderMap) -> Result<String, AuthError> {
        match self {
            Self::Local { user } => Ok(user.clone()),
            Self::Iap(iap) => iap.identify(headers).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use aws_lc_rs::rand::SystemRandom;
    use aws_lc_rs::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair, KeyPair};

    use super::*;

    const AUDIENCE: &str = "/projects/123/global/backendServices/456";
    const NOW: i64 = 1_800_000_000;

    fn key_pair() -> EcdsaKeyPair {
        EcdsaKeyPair::generate(&ECDSA_P256_SHA256_FIXED_SIGNING).expect("a key pair")
    }

    fn keys_of(kid: &str, pair: &EcdsaKeyPair) -> Keys {
        Keys::from([(kid.to_owned(), pair.public_key().as_ref().to_vec())])
    }

    fn token(pair: &EcdsaKeyPair, kid: &str, claims: serde_json::Value) -> String {
        let header = URL_SAFE_NO_PAD.encode(format!(r#"{{"alg":"ES256","kid":"{kid}"}}"#));
        let payload = URL_SAFE_NO_PAD.encode(claims.to_string());
        let signed = format!("{header}.{payload}");
        let signature = pair
            .sign(&SystemRandom::new(), signed.as_bytes())
            .expect("sign");
        format!("{signed}.{}", URL_SAFE_NO_PAD.encode(signature.as_ref()))
    }

    fn claims(aud: &str, exp: i64) -> serde_json::Value {
        serde_json::json!({
            "email": "oncall@example.com",
            "sub": "accounts.google.com:123",
            "aud": aud,
            "iss": IAP_ISSUER,
            "exp": exp,
            "iat": exp - 600,
        })
    }

    #[test]
    fn a_valid_assertion_gives_its_email() {
        let pair = key_pair();
        let t = token(&pair, "k1", claims(AUDIENCE, NOW + 300));
        let c = verify(&t, &keys_of("k1", &pair), AUDIENCE, NOW).expect("valid");
        assert_eq!(c.email, "oncall@example.com");
    }

    #[test]
    fn an_expired_assertion_is_refused() {
        let pair = key_pair();
        let t = token(&pair, "k1", claims(AUDIENCE, NOW - 120));
        assert_eq!(
            verify(&t, &keys_of("k1", &pair), AUDIENCE, NOW),
            Err(AuthError::Claims("expired".into()))
        );
    }

    #[test]
    fn an_assertion_for_another_audience_is_refused() {
        let pair = key_pair();
        let t = token(
            &pair,
            "k1",
            claims("/projects/123/global/backendServices/999", NOW + 300),
        );
        assert!(matches!(
            verify(&t, &keys_of("k1", &pair), AUDIENCE, NOW),
            Err(AuthError::Claims(m)) if m.starts_with("audience")
        ));
    }

    #[test]
    fn an_assertion_signed_by_another_key_or_altered_is_refused() {
        let (pair, other) = (key_pair(), key_pair());
        let t = token(&other, "k1", claims(AUDIENCE, NOW + 300));
        assert_eq!(
            verify(&t, &keys_of("k1", &pair), AUDIENCE, NOW),
            Err(AuthError::Signature),
            "signed by a key that is not the published one"
        );
        let good = token(&pair, "k1", claims(AUDIENCE, NOW + 300));
        let (signed, signature) = good.rsplit_once('.').expect("three parts");
        let (header, _) = signed.split_once('.').expect("two parts");
        let forged = URL_SAFE_NO_PAD.encode(
            serde_json::json!({"email": "mallory@example.com", "aud": AUDIENCE,
                "iss": IAP_ISSUER, "exp": NOW + 300, "iat": NOW})
            .to_string(),
        );
        assert_eq!(
            verify(
                &format!("{header}.{forged}.{signature}"),
                &keys_of("k1", &pair),
                AUDIENCE,
                NOW
            ),
            Err(AuthError::Signature),
            "the payload changed after signing"
        );
        assert_eq!(
            verify(&good, &keys_of("k2", &pair), AUDIENCE, NOW),
            Err(AuthError::Signature),
            "a key id the set lacks"
        );
    }

    #[test]
    fn malformed_assertions_are_refused() {
        let keys = keys_of("k1", &key_pair());
        for t in ["", "a.b", "a.b.c.d", "!!.@@.##"] {
            assert!(
                matches!(
                    verify(t, &keys, AUDIENCE, NOW),
                    Err(AuthError::Malformed(_))
                ),
                "{t:?}"
            );
        }
        let hs256 = format!(
            "{}.{}.sig",
            URL_SAFE_NO_PAD.encode(r#"{"alg":"HS256","kid":"k1"}"#),
            URL_SAFE_NO_PAD.encode("{}")
        );
        assert!(matches!(
            verify(&hs256, &keys, AUDIENCE, NOW),
            Err(AuthError::Malformed(m)) if m.contains("HS256")
        ));
    }

    #[test]
    fn a_jwk_set_gives_its_p256_keys() {
        let pair = key_pair();
        let point = pair.public_key().as_ref();
        let jwks = serde_json::json!({"keys": [
            {"kty": "EC", "crv": "P-256", "kid": "k1", "alg": "ES256", "use": "sig",
             "x": URL_SAFE_NO_PAD.encode(&point[1..33]), "y": URL_SAFE_NO_PAD.encode(&point[33..])},
            {"kty": "RSA", "kid": "r1", "n": "AQAB", "e": "AQAB"}
        ]});
        let keys = parse_keys(jwks.to_string().as_bytes()).expect("parses");
        assert_eq!(keys.len(), 1);
        assert_eq!(keys["k1"], point.to_vec());
        assert!(parse_keys(b"{\"keys\": []}").is_err());
    }
}
