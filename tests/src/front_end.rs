//! A stand-in for Google's front end as a dispatcher on GKE meets it, assembled from the
//! harness's parts: the recording gRPC proxy ([`GrpcRecorder`]) serving TLS with ALPN h2 under a
//! private CA, in front of the Pub/Sub emulator (so what is accepted really arrives), answering
//! refusals by topic when told; the token endpoint ([`TokenServer`]) behind an Application
//! Default Credentials file that names a quota project (so every request must carry
//! `x-goog-user-project`); and the same stand-in as the metadata server for a dispatcher without
//! an ADC file. [`FrontEnd::dispatcher`] is the real `dispatcher` binary pointed at all of it.

use std::path::PathBuf;

use crate::grpc_recorder::{GrpcRecorder, Options, TestCa};
use crate::process::Spawn;
use crate::token_server::TokenServer;

/// The quota project the ADC file names.
pub const QUOTA_PROJECT: &str = "stand-in-quota-project";

/// The front end's parts, stopped when dropped.
#[derive(Debug)]
pub struct FrontEnd {
    /// Every call the dispatcher made, and the refusals it answers.
    pub recorder: GrpcRecorder,
    /// The token endpoint and metadata server.
    pub tokens: TokenServer,
    ca: TestCa,
    dir: PathBuf,
    adc: PathBuf,
}

impl FrontEnd {
    /// Starts the parts, the proxy serving as `options` say.
    pub async fn start(options: Options) -> Self {
        let ca = TestCa::new();
        let recorder =
            GrpcRecorder::start_with(&crate::env::pubsub_emulator_host(), Some(&ca), options).await;
        let tokens = TokenServer::start().await;
        let dir = std::env::temp_dir().join(crate::env::unique_name("front-end"));
        std::fs::create_dir_all(&dir).expect("create a scratch dir");
        let adc = dir.join("adc.json");
        std::fs::write(
            &adc,
            serde_json::json!({
                "type": "authorized_user",
                "client_id": "stand-in-client.apps.googleusercontent.com",
                "client_secret": "stand-in-secret",
                "refresh_token": "stand-in-refresh-token",
                "token_uri": tokens.url("/token"),
                "quota_project_id": QUOTA_PROJECT,
            })
            .to_string(),
        )
        .expect("write the ADC file");
        Self {
            recorder,
            tokens,
            ca,
            dir,
            adc,
        }
    }

    /// The `dispatcher run` binary on `database_url`, publishing through the proxy over TLS
    /// with the ADC file's credentials, every emulator setting removed; `args` come after.
    pub fn dispatcher(&self, database_url: &str, args: &[&str]) -> Spawn {
        self.dispatcher_without_credentials(database_url, args)
            .env("GOOGLE_APPLICATION_CREDENTIALS", &self.adc)
    }

    fn dispatcher_without_credentials(&self, database_url: &str, args: &[&str]) -> Spawn {
        let endpoint = self.recorder.url();
        let ca_file = self.ca.ca_cert.display().to_string();
        Spawn::binary("dispatcher")
            .args([
                "run",
                "--listen-addr",
                "127.0.0.1:0",
                "--pubsub-endpoint",
                &endpoint,
                "--pubsub-ca-file",
                &ca_file,
            ])
            .args(args)
            .env("DATABASE_URL", database_url)
            .env_remove_all(&[
                "PUBSUB_EMULATOR_HOST",
                "OUTBOX_PUBSUB_ENDPOINT",
                "GOOGLE_APPLICATION_CREDENTIALS",
                "GCE_METADATA_HOST",
            ])
    }

    /// As [`Self::dispatcher`], but without an ADC file: the credentials come from the metadata
    /// server (`GCE_METADATA_HOST`: this stand-in), as Workload Identity on GKE gives them.
    pub fn dispatcher_on_gke(&self, database_url: &str, args: &[&str]) -> Spawn {
        let home = self.dir.join("home");
        let _ = std::fs::create_dir_all(&home);
        self.dispatcher_without_credentials(database_url, args)
            // No gcloud credentials of this machine's user may stand in for the metadata server.
            .env("HOME", &home)
            .env("CLOUDSDK_CONFIG", home.join("gcloud"))
            .env("GCE_METADATA_HOST", self.tokens.host())
    }
}

impl Drop for FrontEnd {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
