//! Outages end promptly and are seen promptly: claiming resumes within about a second of Pub/Sub
//! answering again (after a refused-connection cut and after a silent stall), `/readyz` reports
//! each outage, answers within a second while PostgreSQL is unreachable, and `/healthz` fails
//! when a worker is stuck.

use std::time::{Duration, Instant};

use harness::db::TestDb;
use harness::dispatcher::{self as test_dispatcher, Running};
use harness::fixtures::message;
use harness::process::{Process, ReservedPort, http_get};
use harness::proxy::TcpProxy;
use harness::pubsub::TestTopic;
use harness::wait::wait_until;
use outbox_dispatcher::publish::{BatchResult, ProbeError, Publish};
use outbox_dispatcher::publisher::PubsubPublisher;
use outbox_runtime::db::DatabaseArgs;
use outbox_shared::{ClaimedMessage, enqueue_batch};

fn published_total(metrics: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix("outbox_published_total "))
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// Enqueues one message every 50 ms until aborted (a steady trickle of writers).
fn trickle(db: &TestDb, topic: &str) -> tokio::task::JoinHandle<()> {
    let pool = db.pool.clone();
    let topic = topic.to_owned();
    tokio::spawn(async move {
        for i in 0.. {
            if let Ok(mut tx) = pool.begin().await {
                let m = message(&topic, &format!("trickle-{i}"), &[]);
                if enqueue_batch(&mut tx, &[m]).await.is_ok() {
                    let _ = tx.commit().await;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
}

/// Cuts Pub/Sub with `fault` for `length`; returns (cut → /readyz 503, heal → first publish).
async fn outage(
    service: &Running,
    proxy: &TcpProxy,
    length: Duration,
    fault: impl Fn(&TcpProxy, bool),
) -> (Duration, Duration) {
    let addr = service.addr();
    let cut = Instant::now();
    fault(proxy, true);
    let not_ready = wait_until("/readyz reports the outage", length, || async {
        match http_get(&addr, "/readyz").await {
            (503, body) if body.contains("Pub/Sub") => {
                assert!(
                    body.contains(&proxy.addr()),
                    "the reason names the endpoint: {body}"
                );
                for dump in ["MetadataMap", "Some(", "Os {", "Error(", "kind: "] {
                    assert!(
                        !body.contains(dump),
                        "the reason reads as words, not a debug dump ({dump}): {body}"
                    );
                }
                eprintln!("RECOVERY /readyz during the outage: {body}");
                Ok(cut.elapsed())
            }
            (status, body) => Err(format!("{status} {body}")),
        }
    })
    .await;
    tokio::time::sleep(length.saturating_sub(cut.elapsed())).await;
    let before = published_total(&http_get(&addr, "/metrics").await.1);
    let healed = Instant::now();
    fault(proxy, false);
    let recovered = wait_until(
        "a publish after the heal",
        Duration::from_secs(20),
        || async {
            let now = published_total(&http_get(&addr, "/metrics").await.1);
            if now > before {
                Ok(healed.elapsed())
            } else {
                Err(format!("{now} published"))
            }
        },
    )
    .await;
    (not_ready, recovered)
}

#[tokio::test]
async fn claiming_resumes_within_about_a_second_of_pubsub_answering_after_a_cut_and_a_stall() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(false).await;
    let pubsub = TcpProxy::start(&harness::env::pubsub_emulator_host()).await;
    let postgres = TcpProxy::start(&database_host()).await;
    let mut config = test_dispatcher::config_for(&pubsub.addr());
    // The shipped recovery settings, not the fast test ones: that is what is measured.
    config.breaker = outbox_dispatcher::config::BreakerSettings::default();
    config.workers = 2;
    let url = harness_url_through(&db, &postgres.addr());
    let pool = outbox_dispatcher::connect_database(&DatabaseArgs::for_url(url), &config)
        .await
        .expect("the dispatcher's pool connects through the proxy");
    let publisher = test_dispatcher::publisher_at(&pubsub.addr()).await;
    let d = outbox_dispatcher::Dispatcher::build(config, pool, publisher)
        .await
        .expect("builds");
    let service = Running::start(d);
    let writer = trickle(&db, &topic.topic);
    tokio::time::sleep(Duration::from_secs(2)).await;

    let (cut_seen, cut_recovered) = outage(&service, &pubsub, Duration::from_secs(15), |p, on| {
        p.set_down(on)
    })
    .await;
    let (stall_seen, stall_recovered) =
        outage(&service, &pubsub, Duration::from_secs(30), |p, on| {
            p.set_stalled(on)
        })
        .await;
    eprintln!(
        "RECOVERY refused connections 15 s: /readyz 503 after {cut_seen:?}, first publish {cut_recovered:?} after the heal; \
         silent stall 30 s: /readyz 503 after {stall_seen:?}, first publish {stall_recovered:?} after the heal"
    );
    assert!(
        cut_recovered < Duration::from_secs(5),
        "{cut_recovered:?} after a cut"
    );
    assert!(
        stall_recovered < Duration::from_secs(5),
        "{stall_recovered:?} after a stall"
    );

    postgres.set_down(true);
    let asked = Instant::now();
    let (status, body) = http_get(&service.addr(), "/readyz").await;
    let answered = asked.elapsed();
    eprintln!("RECOVERY /readyz with PostgreSQL unreachable: {status} in {answered:?}: {body}");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("database"), "names the database: {body}");
    assert!(
        answered < Duration::from_secs(1),
        "answered in {answered:?}"
    );
    postgres.set_down(false);

    writer.abort();
    service.stop().await;
}

/// `host:port` of the PostgreSQL server behind DATABASE_URL.
fn database_host() -> String {
    let url = harness::env::database_url();
    let after_scheme = url.split_once("://").map_or(url.as_str(), |(_, r)| r);
    let host = after_scheme
        .rsplit_once('@')
        .map_or(after_scheme, |(_, h)| h);
    let host = host.split('/').next().unwrap_or(host);
    if host.contains(':') {
        host.to_owned()
    } else {
        format!("{host}:5432")
    }
}

/// The test database's URL with the host replaced by `addr`.
fn harness_url_through(db: &TestDb, addr: &str) -> String {
    db.url().replacen(&database_host(), addr, 1)
}

/// A publisher whose publishes never answer (a wedged client), while probes succeed.
#[derive(Debug)]
struct Wedged;

impl Publish for Wedged {
    async fn publish(&self, _batch: &[ClaimedMessage]) -> BatchResult {
        std::future::pending().await
    }
    async fn probe(&self, _topic: &str) -> Result<(), ProbeError> {
        Ok(())
    }
    fn dedupe_attribute(&self) -> &str {
        outbox_shared::DEFAULT_DEDUPE_ATTRIBUTE
    }
}

#[tokio::test]
async fn a_slow_but_answering_pubsub_is_not_an_outage() {
    let db = TestDb::new().await;
    let topic = TestTopic::new(false).await;
    // 1.5 s each way: every publish and every probe takes over 3 s, past the stall probe's
    // trigger (1 s here) and its first 2 s deadline.
    let proxy = TcpProxy::start(&harness::env::pubsub_emulator_host()).await;
    proxy.set_delay(Duration::from_millis(1500));
    harness::fixtures::enqueue_numbered(&db.pool, &topic.topic, 20).await;
    let mut config = test_dispatcher::config_for(&proxy.addr());
    config.workers = 1;
    config.stall_probe_after = Duration::from_secs(1);
    config.pubsub.publish_timeout = Duration::from_secs(40);
    config.lock_timeout = Duration::from_secs(60);
    let publisher = PubsubPublisher::connect(&config.pubsub)
        .await
        .expect("the publisher connects");
    let service = Running::start(test_dispatcher::build_service(&db, publisher, config).await);
    harness::wait::drained(&db.pool, Duration::from_secs(90)).await;
    let metrics = http_get(&service.addr(), "/metrics").await.1;
    service.stop().await;
    let outages = metrics
        .lines()
        .find_map(|l| l.strip_prefix("outbox_outage_batches_total "))
        .and_then(|v| v.parse::<f64>().ok());
    eprintln!("SLOW: 20 messages at a 3 s round trip; outage batches: {outages:?}");
    assert_eq!(outages, Some(0.0), "no batch was taken for an outage");
    assert_eq!(topic.pull(20, Duration::from_secs(3)).await.len(), 20);
}

#[tokio::test]
async fn a_stuck_worker_makes_healthz_fail() {
    let db = TestDb::new().await;
    let mut config = test_dispatcher::config();
    config.workers = 1;
    config.pubsub.publish_timeout = Duration::from_millis(300);
    config.lock_timeout = Duration::from_millis(600);
    config.liveness_timeout = Duration::from_millis(1500);
    config.stall_probe_after = Duration::from_millis(100);
    let service = Running::start(test_dispatcher::build_service(&db, Wedged, config).await);
    let addr = service.addr();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(http_get(&addr, "/healthz").await.0, 200, "alive while idle");
    harness::fixtures::enqueue(&db.pool, &[message("projects/p/topics/t", "m", &[])]).await;
    let body = wait_until("/healthz fails", Duration::from_secs(10), || async {
        match http_get(&addr, "/healthz").await {
            (503, body) => Ok(body),
            (status, body) => Err(format!("{status} {body}")),
        }
    })
    .await;
    assert!(body.contains("worker 0 has made no progress"), "{body}");
    // It cannot stop cleanly (the batch never ends): end it as the orchestrator would.
    service.abort();
}

#[tokio::test]
async fn text_logs_written_to_a_pipe_carry_no_colour_escapes() {
    let refused = ReservedPort::new();
    let mut p = Process::spawn(
        "dispatcher",
        &[
            "--database-url",
            &format!("postgres://outbox@127.0.0.1:{}/outbox", refused.port()),
            "--db-connect-timeout",
            "1s",
            "--listen-addr",
            "127.0.0.1:0",
        ],
        &[],
    );
    let status = tokio::time::timeout(Duration::from_secs(20), p.child.wait())
        .await
        .expect("exits")
        .expect("status");
    assert!(!status.success(), "nothing listens there");
    let log = p.log();
    assert!(log.contains("PostgreSQL is not reachable yet"), "{log}");
    assert!(
        !log.contains('\u{1b}'),
        "no ANSI escapes in a log file: {log:?}"
    );
}
