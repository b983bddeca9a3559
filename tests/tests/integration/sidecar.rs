//! The producer stops its sidecar when it exits (`--sidecar-quit-url`): a stand-in for the Cloud
//! SQL Auth Proxy's admin port (`POST /quitquitquit`) counts the calls while the real `producer`
//! binary ends each way it can: success, a failure at run time, a configuration error, SIGTERM.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use harness::bigquery::TestTable;
use harness::db::TestDb;
use harness::env;
use harness::process::{Process, output};
use harness::wait::outbox_at_least;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use harness::producer::{order, orders_schema, orders_toml};

/// The proxy's admin port, standing in: answers every request 200 and counts `POST /quitquitquit`
/// (and anything else, which must not come).
struct AdminPort {
    url: String,
    quits: Arc<AtomicUsize>,
    others: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl AdminPort {
    async fn start() -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the stand-in admin port");
        let url = format!(
            "http://{}/quitquitquit",
            listener.local_addr().expect("its address")
        );
        let (quits, others) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (q, o) = (quits.clone(), others.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let mut buf = vec![0u8; 4096];
                let n = s.read(&mut buf).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]).into_owned();
                if head.starts_with("POST /quitquitquit ") {
                    q.fetch_add(1, Ordering::SeqCst);
                } else {
                    o.fetch_add(1, Ordering::SeqCst);
                }
                let _ = s
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                    .await;
            }
        });
        Self {
            url,
            quits,
            others,
            task,
        }
    }

    fn calls(&self) -> (usize, usize) {
        (
            self.quits.load(Ordering::SeqCst),
            self.others.load(Ordering::SeqCst),
        )
    }
}

impl Drop for AdminPort {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn producer_env(db: &TestDb, quit_url: &str) -> Vec<(&'static str, String)> {
    vec![
        ("DATABASE_URL", db.url().to_owned()),
        ("BIGQUERY_EMULATOR_HOST", env::bigquery_emulator_host()),
        ("BIGQUERY_PROJECT_ID", env::bigquery_project()),
        ("PUBSUB_PROJECT_ID", env::pubsub_project()),
        ("OUTBOX_SIDECAR_QUIT_URL", quit_url.to_owned()),
        ("OUTBOX_LOG", "warn".to_owned()),
    ]
}

fn config_file(name: &str, text: &str) -> std::path::PathBuf {
    let path = std::env::temp_dir().join(format!("{}.toml", env::unique_name(name)));
    std::fs::write(&path, text).expect("write the streams file");
    path
}

#[tokio::test]
async fn the_sidecar_is_told_to_exit_exactly_once_on_success_failure_and_configuration_error() {
    let db = TestDb::new().await;
    let table = TestTable::create(orders_schema()).await;
    table
        .insert(&(1..=20).map(|i| order(i, i)).collect::<Vec<_>>())
        .await;
    let good = config_file("sidecar-ok", &orders_toml(&table, "sidecar_ok", ""));
    // The same stream over a dataset that does not exist: BigQuery refuses the query at run time.
    let missing = config_file(
        "sidecar-fail",
        &orders_toml(&table, "sidecar_fail", "").replace(&table.dataset, "no_such_dataset"),
    );
    let absent = std::env::temp_dir().join(env::unique_name("no-such-streams-file"));
    for (what, config, want) in [
        ("success", good.clone(), 0),
        ("a failure at run time", missing, 1),
        ("a configuration error", absent, 2),
    ] {
        let admin = AdminPort::start().await;
        let config = config.to_string_lossy().into_owned();
        let out = output(
            "producer",
            &["run", "--config", &config],
            &producer_env(&db, &admin.url),
        )
        .await;
        assert_eq!(
            out.status.code(),
            Some(want),
            "{what}: exit code; stderr: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            admin.calls(),
            (1, 0),
            "{what}: one POST /quitquitquit and nothing else"
        );
    }
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM pubsub_outbox")
        .fetch_one(&db.pool)
        .await
        .expect("count");
    assert_eq!(
        rows, 20,
        "the successful run enqueued its rows before the sidecar was stopped"
    );
}

#[tokio::test]
async fn the_sidecar_is_told_to_exit_once_when_the_producer_is_stopped_by_sigterm() {
    let db = TestDb::new().await;
    let table = TestTable::create(orders_schema()).await;
    table
        .insert(&(1..=3000).map(|i| order(i, i / 5)).collect::<Vec<_>>())
        .await;
    let config = config_file("sidecar-term", &orders_toml(&table, "sidecar_term", ""));
    let admin = AdminPort::start().await;
    let config = config.to_string_lossy().into_owned();
    let mut p = Process::spawn(
        "producer",
        &["run", "--page-size", "5", "--config", &config],
        &producer_env(&db, &admin.url),
    );
    // SIGTERM once the run is under way (some pages committed).
    outbox_at_least(
        &db.pool,
        50,
        Duration::from_secs(60),
        "the run commits pages",
    )
    .await;
    assert_eq!(
        admin.calls(),
        (0, 0),
        "nothing is called while the run goes on"
    );
    p.signal("TERM");
    let status = tokio::time::timeout(Duration::from_secs(30), p.child.wait())
        .await
        .expect("the producer exits within 30 s of SIGTERM")
        .expect("wait");
    assert!(
        status.code().is_some(),
        "it exits by itself, not by a signal: {status}; log:\n{}",
        p.log()
    );
    assert_eq!(
        admin.calls(),
        (1, 0),
        "one POST /quitquitquit; log:\n{}",
        p.log()
    );
}

#[tokio::test]
async fn a_quit_url_that_is_not_http_exits_2_with_the_fix_and_calls_nothing() {
    let db = TestDb::new().await;
    let out = output(
        "producer",
        &["run", "--config", "/nonexistent/streams.toml"],
        &producer_env(&db, "127.0.0.1:9091/quitquitquit"),
    )
    .await;
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--sidecar-quit-url")
            && stderr.contains("http://127.0.0.1:9091/quitquitquit"),
        "{stderr}"
    );
}
