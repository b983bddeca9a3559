//! The producer's BigQuery credentials come from `google-cloud-auth` (the dispatcher's OAuth
//! stack), so every Application Default Credentials file type works: a service account key, an
//! `authorized_user` (gcloud login), an `impersonated_service_account` (gcloud login with
//! `--impersonate-service-account`) and an `external_account` (Workload Identity Federation).
//! Each test runs the real `producer` binary with `--bigquery-credentials adc` against bqemulator
//! through a recording HTTP proxy (`HttpFaults`: every request's `Authorization`), with the token
//! endpoints played by a local stand-in (`TokenServer`), and checks the run enqueued its rows
//! with the token each file type must produce.

use std::path::{Path, PathBuf};
use std::time::Duration;

use harness::bigquery::TestTable;
use harness::db::TestDb;
use harness::env;
use harness::http_faults::HttpFaults;
use harness::process::Spawn;
use harness::token_server::{
    FEDERATED_TOKEN, IMPERSONATED_TOKEN, TokenRequest, TokenServer, USER_TOKEN,
};
use serde_json::json;

use harness::producer::{order, orders_schema, orders_toml};

/// Rows of the stream.
const ROWS: i64 = 12;

struct Outcome {
    /// `Authorization` of every BigQuery request.
    authorizations: Vec<String>,
    /// What the token stand-in was asked.
    token_requests: Vec<TokenRequest>,
}

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(env::unique_name(name));
    std::fs::create_dir_all(&dir).expect("create a scratch dir");
    dir
}

/// Runs `producer run --bigquery-credentials adc` with `adc` as GOOGLE_APPLICATION_CREDENTIALS
/// (and an empty HOME, so no gcloud file is found) and asserts it enqueued every row.
async fn run_with(tokens: &TokenServer, dir: &Path, adc: serde_json::Value) -> Outcome {
    let db = TestDb::new().await;
    let table = TestTable::create(orders_schema()).await;
    table
        .insert(&(1..=ROWS).map(|i| order(i, i)).collect::<Vec<_>>())
        .await;
    let config = dir.join("streams.toml");
    std::fs::write(&config, orders_toml(&table, "creds", "")).expect("write the streams file");
    let adc_file = dir.join("adc.json");
    std::fs::write(&adc_file, adc.to_string()).expect("write the credentials file");
    let upstream = env::bigquery_emulator_host();
    let bigquery = HttpFaults::start(upstream.trim_start_matches("http://")).await;
    let out = Spawn::binary("producer")
        .args([
            "run",
            "--config",
            &config.to_string_lossy(),
            "--bigquery-endpoint",
            &bigquery.url(),
            "--bigquery-credentials",
            "adc",
        ])
        .env("DATABASE_URL", db.url())
        .env("BIGQUERY_PROJECT_ID", env::bigquery_project())
        .env("PUBSUB_PROJECT_ID", env::pubsub_project())
        .env("GOOGLE_APPLICATION_CREDENTIALS", &adc_file)
        .env("HOME", dir)
        .env("OUTBOX_LOG", "warn")
        .env_remove_all(&["BIGQUERY_EMULATOR_HOST", "GCE_METADATA_HOST"])
        .output(Duration::from_secs(60))
        .await
        .expect("run the producer");
    assert!(
        out.status.success(),
        "producer run: {}; stderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM pubsub_outbox")
        .fetch_one(&db.pool)
        .await
        .expect("count");
    assert_eq!(rows, ROWS, "every row enqueued");
    let authorizations = bigquery.authorizations();
    assert!(!authorizations.is_empty(), "the run called BigQuery");
    Outcome {
        authorizations,
        token_requests: tokens.requests(),
    }
}

fn all_bearer(o: &Outcome, token: &str) {
    let want = format!("Bearer {token}");
    assert!(
        o.authorizations.iter().all(|a| *a == want),
        "every BigQuery request carries {want:?}: {:?}",
        o.authorizations
    );
}

/// An `authorized_user` JSON whose token endpoint is the stand-in.
fn authorized_user(tokens: &TokenServer) -> serde_json::Value {
    json!({
        "type": "authorized_user",
        "client_id": "stand-in-client.apps.googleusercontent.com",
        "client_secret": "stand-in-secret",
        "refresh_token": "stand-in-refresh-token",
        "token_uri": tokens.url("/token"),
    })
}

#[tokio::test]
async fn a_service_account_key_signs_its_own_bigquery_token() {
    let tokens = TokenServer::start().await;
    let dir = scratch_dir("creds-sa");
    let key = dir.join("key.pem");
    let status = std::process::Command::new("openssl")
        .args([
            "genpkey",
            "-algorithm",
            "RSA",
            "-pkeyopt",
            "rsa_keygen_bits:2048",
            "-out",
        ])
        .arg(&key)
        .stderr(std::process::Stdio::null())
        .status()
        .expect("run openssl");
    assert!(status.success(), "openssl genpkey");
    let email = "outbox-producer@stand-in.iam.gserviceaccount.com";
    let o = run_with(
        &tokens,
        &dir,
        json!({
            "type": "service_account",
            "project_id": "stand-in",
            "private_key_id": "stand-in-key-1",
            "private_key": std::fs::read_to_string(&key).expect("read the key"),
            "client_email": email,
            "client_id": "1234567890",
            "token_uri": tokens.url("/token"),
        }),
    )
    .await;
    // A self-signed JWT (no token endpoint): header.claims.signature, issued by the account,
    // for BigQuery's scope.
    for a in &o.authorizations {
        let jwt = a.strip_prefix("Bearer ").expect("a bearer token");
        let parts: Vec<&str> = jwt.split('.').collect();
        assert_eq!(parts.len(), 3, "a JWT: {jwt}");
        let claims = base64url(parts[1]);
        assert!(claims.contains(email), "{claims}");
        assert!(
            claims.contains("https://www.googleapis.com/auth/bigquery"),
            "{claims}"
        );
    }
    assert!(o.token_requests.is_empty(), "{:?}", o.token_requests);
}

#[tokio::test]
async fn gcloud_user_credentials_refresh_at_the_token_endpoint() {
    let tokens = TokenServer::start().await;
    let dir = scratch_dir("creds-user");
    let o = run_with(&tokens, &dir, authorized_user(&tokens)).await;
    all_bearer(&o, USER_TOKEN);
    assert!(
        o.token_requests
            .iter()
            .all(|r| r.request_line.starts_with("POST /token ")
                && r.body.contains("refresh_token")
                && r.body.contains("stand-in-refresh-token")),
        "{:?}",
        o.token_requests
    );
    assert!(!o.token_requests.is_empty());
}

#[tokio::test]
async fn impersonated_credentials_exchange_the_source_token_for_the_service_accounts() {
    let tokens = TokenServer::start().await;
    let dir = scratch_dir("creds-impersonated");
    let target = "outbox-producer@stand-in.iam.gserviceaccount.com";
    let o = run_with(
        &tokens,
        &dir,
        json!({
            "type": "impersonated_service_account",
            "service_account_impersonation_url": tokens.url(&format!(
                "/v1/projects/-/serviceAccounts/{target}:generateAccessToken"
            )),
            "source_credentials": authorized_user(&tokens),
            "delegates": [],
        }),
    )
    .await;
    all_bearer(&o, IMPERSONATED_TOKEN);
    let generate: Vec<&TokenRequest> = o
        .token_requests
        .iter()
        .filter(|r| r.request_line.contains(":generateAccessToken"))
        .collect();
    assert!(!generate.is_empty(), "{:?}", o.token_requests);
    for r in generate {
        assert_eq!(
            r.authorization,
            format!("Bearer {USER_TOKEN}"),
            "asked with the source token"
        );
        assert!(
            r.body.contains("https://www.googleapis.com/auth/bigquery"),
            "{}",
            r.body
        );
    }
}

#[tokio::test]
async fn workload_identity_federation_exchanges_the_subject_token_at_sts() {
    let tokens = TokenServer::start().await;
    let dir = scratch_dir("creds-external");
    let subject = dir.join("subject-token.jwt");
    std::fs::write(&subject, "stand-in-subject-token").expect("write the subject token");
    let o = run_with(
        &tokens,
        &dir,
        json!({
            "type": "external_account",
            "audience": "//iam.googleapis.com/projects/123/locations/global/workloadIdentityPools/pool/providers/provider",
            "subject_token_type": "urn:ietf:params:oauth:token-type:jwt",
            "token_url": tokens.url("/sts"),
            "credential_source": {"file": subject.to_string_lossy()},
        }),
    )
    .await;
    all_bearer(&o, FEDERATED_TOKEN);
    assert!(
        o.token_requests
            .iter()
            .any(|r| r.request_line.starts_with("POST /sts ")
                && r.body.contains("stand-in-subject-token")),
        "{:?}",
        o.token_requests
    );
}

/// Decodes unpadded base64url (a JWT segment) to text.
fn base64url(s: &str) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut bits = 0u32;
    let mut n = 0;
    let mut out = Vec::new();
    for c in s.bytes() {
        let Some(v) = ALPHABET.iter().position(|a| *a == c) else {
            continue;
        };
        bits = (bits << 6) | v as u32;
        n += 6;
        if n >= 8 {
            n -= 8;
            out.push((bits >> n) as u8);
            bits &= (1 << n) - 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}
