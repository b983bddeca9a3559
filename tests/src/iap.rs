//! A stand-in for Identity-Aware Proxy, for the console's tests: a P-256 key pair whose public key
//! it serves as Google's JWK set (`GET /jwk`, the shape www.gstatic.com/iap/verify/public_key-jwk
//! has), and assertions signed as IAP signs them (ES256), valid or not in each way a test needs.

use aws_lc_rs::rand::SystemRandom;
use aws_lc_rs::signature::{ECDSA_P256_SHA256_FIXED_SIGNING, EcdsaKeyPair, KeyPair};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;
use tokio::task::AbortHandle;

use crate::http_faults::read_request;

/// The key id the stand-in publishes.
pub const KID: &str = "stand-in-iap-key";

/// A running stand-in; stops when dropped.
#[derive(Debug)]
pub struct IapStandIn {
    pair: EcdsaKeyPair,
    base: String,
    accept: AbortHandle,
}

impl Drop for IapStandIn {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

impl IapStandIn {
    /// Starts serving the key set on a loopback port.
    pub async fn start() -> Self {
        let pair = EcdsaKeyPair::generate(&ECDSA_P256_SHA256_FIXED_SIGNING).expect("a key pair");
        let point = pair.public_key().as_ref().to_vec();
        let jwks = serde_json::json!({"keys": [{
            "alg": "ES256", "crv": "P-256", "kid": KID, "kty": "EC", "use": "sig",
            "x": URL_SAFE_NO_PAD.encode(&point[1..33]),
            "y": URL_SAFE_NO_PAD.encode(&point[33..]),
        }]})
        .to_string();
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let base = format!(
            "http://{}",
            listener.local_addr().expect("the stand-in's address")
        );
        let accept = tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let jwks = jwks.clone();
                tokio::spawn(async move {
                    let _ = read_request(&mut conn).await;
                    let answer = format!(
                        "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{jwks}",
                        jwks.len()
                    );
                    let _ = conn.write_all(answer.as_bytes()).await;
                });
            }
        })
        .abort_handle();
        Self { pair, base, accept }
    }

    /// The key set's URL (`--iap-keys-url`).
    pub fn keys_url(&self) -> String {
        format!("{}/jwk", self.base)
    }

    /// An assertion for `email` and `audience`, expiring `expires_in` seconds from now (negative:
    /// already expired).
    pub fn assertion(&self, email: &str, audience: &str, expires_in: i64) -> String {
        sign(&self.pair, email, audience, expires_in)
    }

    /// A valid-looking assertion signed by a key the stand-in does not publish.
    pub fn forged(email: &str, audience: &str) -> String {
        let other = EcdsaKeyPair::generate(&ECDSA_P256_SHA256_FIXED_SIGNING).expect("a key pair");
        sign(&other, email, audience, 600)
    }
}

fn sign(pair: &EcdsaKeyPair, email: &str, audience: &str, expires_in: i64) -> String {
    let now = chrono::Utc::now().timestamp();
    let header = URL_SAFE_NO_PAD.encode(format!(r#"{{"alg":"ES256","kid":"{KID}","typ":"JWT"}}"#));
    let claims = serde_json::json!({
        "aud": audience, "email": email, "exp": now + expires_in, "iat": now.min(now + expires_in - 60),
        "iss": "https://cloud.google.com/iap", "sub": format!("accounts.google.com:{email}"),
    });
    let payload = URL_SAFE_NO_PAD.encode(claims.to_string());
    let signed = format!("{header}.{payload}");
    let signature = pair
        .sign(&SystemRandom::new(), signed.as_bytes())
        .expect("sign");
    format!("{signed}.{}", URL_SAFE_NO_PAD.encode(signature.as_ref()))
}
