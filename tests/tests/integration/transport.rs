//! The Publish transport (dispatcher/src/pubsub/transport.rs) as Pub/Sub sees it: through a proxy that
//! records and decodes every gRPC call, the real `dispatcher` binary sends one ordering key per
//! request, at most 1,000 messages and 10 MB, the `authorization` header of its Application
//! Default Credentials on every request (a new token once the old one expired), a `grpc-timeout`
//! and the routing header, over TLS signed by a private CA it was told to trust; and when the
//! emulator is killed mid-drain and started again, its connections come back and every message
//! the dead emulator had not acknowledged is delivered by the new one, in its key's order.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use harness::db::TestDb;
use harness::dispatcher::{self as test_dispatcher, Running};
use harness::fixtures::{enqueue, keyed_dedupe, keyed_messages, message};
use harness::grpc_recorder::{GrpcRecorder, TestCa};
use harness::process::{ReservedPort, Spawn};
use harness::proxy::TcpProxy;
use harness::pubsub::{Received, TestTopic};
use harness::token_server::TokenServer;
use harness::wait::{drained, wait_until};
use outbox_shared::NewMessage;

fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(harness::env::unique_name(name));
    std::fs::create_dir_all(&dir).expect("create a scratch dir");
    dir
}

/// Rows of `bytes` bytes each, unkeyed, dedupe keys `{prefix}-{i}`.
fn unkeyed(topic: &str, prefix: &str, n: usize, bytes: usize) -> Vec<NewMessage> {
    (0..n)
        .map(|i| {
            let mut m = message(topic, &format!("{prefix}-{i}"), &[]);
            m.payload = vec![b'x'; bytes];
            m
        })
        .collect()
}

/// Per ordering key, the dedupe keys in the order they arrived.
fn by_key(received: &[Received]) -> BTreeMap<String, Vec<String>> {
    let mut keys: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for m in harness::pubsub::by_publish_order(received) {
        if !m.ordering_key.is_empty() {
            keys.entry(m.ordering_key.clone())
                .or_default()
                .push(m.dedupe_key().to_owned());
        }
    }
    keys
}

#[tokio::test]
async fn every_request_holds_one_key_within_the_limits_with_a_live_token_and_a_deadline_over_a_private_ca()
 {
    let db = TestDb::new().await;
    let topic = TestTopic::new(true).await;
    let ca = TestCa::new();
    let recorder = GrpcRecorder::start(&harness::env::pubsub_emulator_host(), Some(&ca)).await;
    // Tokens that expire 3 s after they are handed out: google-cloud-auth fetches a new one
    // (every 10 s when a token lasts under 4 minutes) and never hands out an expired one.
    let tokens = TokenServer::start_expiring(Duration::from_secs(3)).await;
    let dir = scratch_dir("transport-adc");
    let adc = dir.join("adc.json");
    std::fs::write(
        &adc,
        serde_json::json!({
            "type": "authorized_user",
            "client_id": "stand-in-client.apps.googleusercontent.com",
            "client_secret": "stand-in-secret",
            "refresh_token": "stand-in-refresh-token",
            "token_uri": tokens.url("/token"),
        })
        .to_string(),
    )
    .expect("write the ADC file");

    // 2,300 small unkeyed rows (requests of at most 1,000), six of 3 MB (at most three in a
    // request under 10 MB), and three keys of four rows.
    let t = &topic.topic;
    let mut first = unkeyed(t, "small", 2300, 100);
    first.extend(unkeyed(t, "big", 6, 3_000_000));
    first.extend(keyed_messages(t, 3, 4));
    enqueue(&db.pool, &first).await;

    let endpoint = recorder.url();
    let ca_file = ca.ca_cert.display().to_string();
    let mut dispatcher = Spawn::binary("dispatcher")
        .args([
            "run",
            "--listen-addr",
            "127.0.0.1:0",
            "--pubsub-endpoint",
            &endpoint,
            "--pubsub-ca-file",
            &ca_file,
            "--batch-size",
            "1000",
            "--poll-interval",
            "50ms",
            "--max-poll-interval",
            "200ms",
        ])
        .env("DATABASE_URL", db.url())
        .env("GOOGLE_APPLICATION_CREDENTIALS", &adc)
        .env_remove_all(&["PUBSUB_EMULATOR_HOST", "OUTBOX_PUBSUB_ENDPOINT"])
        .start()
        .expect("start the dispatcher");
    dispatcher
        .bound_addr(Duration::from_secs(30))
        .await
        .expect("the dispatcher serves its endpoints");
    drained(&db.pool, Duration::from_secs(90)).await;
    let first_token = tokens
        .issued()
        .first()
        .expect("a token was fetched")
        .token
        .clone();
    // A second wave once the first token has expired and the credentials fetched another.
    wait_until("a second token", Duration::from_secs(40), || async {
        match tokens.issued().len() {
            n if n >= 2 => Ok(()),
            n => Err(format!("{n} token(s) so far")),
        }
    })
    .await;
    let second = keyed_messages(t, 3, 6)
        .into_iter()
        .skip(12)
        .collect::<Vec<_>>();
    enqueue(&db.pool, &second).await;
    drained(&db.pool, Duration::from_secs(60)).await;
    dispatcher.signal("TERM");

    let issued: HashMap<String, _> = tokens
        .issued()
        .into_iter()
        .map(|i| (i.token.clone(), i))
        .collect();
    let publishes = recorder.publishes();
    let params = format!("topic={}", t.replace('/', "%2F"));
    let mut used = HashSet::new();
    for call in &publishes {
        let keys = call.ordering_keys();
        assert_eq!(keys.len(), 1, "one ordering key per request: {keys:?}");
        assert!(call.messages() <= 1000, "{} messages", call.messages());
        assert!(call.size <= 10_000_000, "{} bytes", call.size);
        assert!(
            !call.grpc_timeout.is_empty(),
            "grpc-timeout on every request"
        );
        assert_eq!(call.request_params, params, "the routing header");
        assert!(
            call.api_client.contains("pubsub-outbox"),
            "{}",
            call.api_client
        );
        assert!(
            call.user_agent.starts_with("pubsub-outbox/"),
            "{}",
            call.user_agent
        );
        let token = call
            .authorization
            .strip_prefix("Bearer ")
            .unwrap_or_else(|| panic!("a bearer token on every request: {:?}", call.authorization));
        let handed = issued
            .get(token)
            .unwrap_or_else(|| panic!("{token:?} is a token the stand-in handed out"));
        assert!(
            call.at <= handed.expires + Duration::from_millis(500),
            "{token} was sent {:?} after it expired",
            call.at - handed.expires
        );
        used.insert(token.to_owned());
    }
    let last = publishes.last().expect("requests were sent");
    assert_ne!(
        last.authorization,
        format!("Bearer {first_token}"),
        "after the first token expired, requests carry a new one"
    );
    assert!(used.len() >= 2, "tokens used: {used:?}");
    let most = publishes.iter().map(|c| c.messages()).max().unwrap_or(0);
    // A claim of 1,000 rows also holds keyed and big rows, so the unkeyed request of a batch is
    // near 1,000, not exactly (the exact packing is `parts::plan`'s unit test).
    assert!(
        most > 500,
        "unkeyed rows are packed into requests of up to 1,000: at most {most}"
    );
    let big_requests: Vec<usize> = publishes
        .iter()
        .filter_map(|c| c.publish.as_ref())
        .map(|p| {
            p.messages
                .iter()
                .filter(|m| m.data.len() == 3_000_000)
                .count()
        })
        .filter(|n| *n > 0)
        .collect();
    assert!(
        big_requests.iter().all(|n| *n <= 3) && big_requests.iter().sum::<usize>() == 6,
        "3 MB rows go at most three to a 10 MB request: {big_requests:?}"
    );

    let expected = first.len() + second.len();
    let received = topic.pull(expected, Duration::from_secs(5)).await;
    let counts = harness::pubsub::by_dedupe_key(&received);
    assert_eq!(counts.len(), expected, "every row arrived");
    let keyed = by_key(&received);
    for (key, seen) in &keyed {
        let k: usize = key.trim_start_matches("key-").parse().expect("key-NNN");
        let want: Vec<String> = (0..6).map(|seq| keyed_dedupe(k, seq)).collect();
        let mut firsts = Vec::new();
        for d in seen {
            if !firsts.contains(d) {
                firsts.push(d.clone());
            }
        }
        assert_eq!(firsts, want, "key {key} in order");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// The private emulator of the restart test, on its own port.
struct Emulator {
    process: harness::process::Process,
}

impl Emulator {
    fn bin() -> String {
        std::env::var("PUBSUB_EMULATOR_BIN").unwrap_or_else(|_| {
            "/usr/lib/google-cloud-sdk/platform/pubsub-emulator/bin/cloud-pubsub-emulator"
                .to_owned()
        })
    }

    async fn start(port: u16, topic: &str, subscription: &str) -> Self {
        let process = Spawn::program(Self::bin())
            .args(["--host=127.0.0.1".to_owned(), format!("--port={port}")])
            .start()
            .expect("start a private Pub/Sub emulator");
        let endpoint = format!("http://127.0.0.1:{port}");
        wait_until(
            "the private emulator answers",
            Duration::from_secs(60),
            || {
                let endpoint = endpoint.clone();
                async move {
                    match tokio::net::TcpStream::connect(endpoint.trim_start_matches("http://"))
                        .await
                    {
                        Ok(_) => Ok(()),
                        Err(e) => Err(e.to_string()),
                    }
                }
            },
        )
        .await;
        harness::pubsub::create_topic_at(&endpoint, topic, None).await;
        harness::pubsub::create_subscription_at(&endpoint, topic, subscription, true, 60).await;
        Self { process }
    }
}

#[tokio::test]
async fn after_the_emulator_is_killed_mid_drain_and_restarted_the_connections_come_back_and_nothing_is_lost()
 {
    let db = TestDb::new().await;
    let project = harness::env::pubsub_project();
    let topic = format!(
        "projects/{project}/topics/{}",
        harness::env::unique_name("t")
    );
    let subscription = format!(
        "projects/{project}/subscriptions/{}",
        harness::env::unique_name("s")
    );
    let port = ReservedPort::new().port();
    let mut emulator = Emulator::start(port, &topic, &subscription).await;
    let endpoint = format!("http://127.0.0.1:{port}");
    // The dispatcher reaches the emulator through a proxy adding 5 ms each way, so the drain
    // lasts long enough to be cut in the middle; the proxy passes the emulator's death on (its
    // connections close with the upstream's).
    let proxy = TcpProxy::start(&format!("127.0.0.1:{port}")).await;
    proxy.set_delay(Duration::from_millis(5));

    let mut rows = keyed_messages(&topic, 20, 60);
    rows.extend(unkeyed(&topic, "plain", 2000, 200));
    enqueue(&db.pool, &rows).await;
    // What the new emulator delivers (what the dead one held died with it: not ours to count).
    let pulled = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Received>::new()));

    let mut config = test_dispatcher::config_for(&proxy.addr());
    config.workers = 2;
    config.batch.batch_size = 50;
    config.retention = Duration::from_secs(3600);
    config.batch.retain_published = true;
    let publisher = test_dispatcher::publisher_at(&proxy.addr()).await;
    let service = Running::start(test_dispatcher::build_service(&db, publisher, config).await);

    let published = || async {
        harness::fixtures::count(
            &db.pool,
            "SELECT count(*) FROM pubsub_outbox WHERE published_at IS NOT NULL",
        )
        .await
    };
    wait_until(
        "a third of the rows published",
        Duration::from_secs(60),
        || async {
            match published().await {
                n if n >= 1000 => Ok(()),
                n => Err(format!("{n} published")),
            }
        },
    )
    .await;
    emulator.process.signal("KILL");
    let _ = emulator.process.child.wait().await;
    // Down until the new emulator has the topic again (a publish to a topic not yet created
    // would be refused NOT_FOUND: a dead letter that says nothing about the transport).
    proxy.set_down(true);
    let at_kill = published().await;
    assert!(
        at_kill < rows.len() as i64,
        "the kill came mid-drain ({at_kill} of {} published)",
        rows.len()
    );
    let _emulator = Emulator::start(port, &topic, &subscription).await;
    let (restarted,): (chrono::DateTime<chrono::Utc>,) = sqlx::query_as("SELECT now()")
        .fetch_one(&db.pool)
        .await
        .expect("the database clock");
    let collector = {
        let pulled = pulled.clone();
        let (endpoint, subscription) = (endpoint.clone(), subscription.clone());
        tokio::spawn(async move {
            let mut stream = harness::pubsub::stream_at(&endpoint, &subscription).await;
            while let Some(Ok((msg, handler))) = stream.next().await {
                handler.ack();
                if let Ok(mut p) = pulled.lock() {
                    p.push(Received {
                        data: msg.data.to_vec(),
                        attributes: msg.attributes,
                        ordering_key: msg.ordering_key,
                        message_id: msg.message_id,
                    });
                }
            }
        })
    };
    let started = Instant::now();
    proxy.set_down(false);
    drained(&db.pool, Duration::from_secs(120)).await;
    eprintln!(
        "RESTART {at_kill} of {} rows published before the kill; the rest after the restart in {:?}",
        rows.len(),
        started.elapsed()
    );
    service.stop().await;
    assert_eq!(
        harness::fixtures::dead_letters(&db.pool).await,
        0,
        "nothing dead-lettered"
    );
    let after: Vec<(String,)> =
        sqlx::query_as("SELECT dedupe_key FROM pubsub_outbox WHERE published_at > $1 ORDER BY id")
            .bind(restarted)
            .fetch_all(&db.pool)
            .await
            .expect("rows published after the restart");
    assert!(
        after.len() as i64 >= rows.len() as i64 - at_kill - 200,
        "the connections came back: {} rows published after the restart",
        after.len()
    );
    let want: HashSet<String> = after.into_iter().map(|(d,)| d).collect();
    wait_until(
        "the new emulator delivers every row it acknowledged",
        Duration::from_secs(60),
        || async {
            let got: HashSet<String> = pulled
                .lock()
                .map(|p| p.iter().map(|m| m.dedupe_key().to_owned()).collect())
                .unwrap_or_default();
            match want.difference(&got).count() {
                0 => Ok(()),
                n => Err(format!("{n} of {} not yet delivered", want.len())),
            }
        },
    )
    .await;
    collector.abort();
    let received = pulled.lock().map(|p| p.clone()).unwrap_or_default();
    for (key, seen) in by_key(&received) {
        let seqs: Vec<usize> = seen
            .iter()
            .filter_map(|d| d.rsplit("-m").next()?.parse().ok())
            .collect();
        let mut firsts: Vec<usize> = Vec::new();
        for s in seqs {
            if !firsts.contains(&s) {
                firsts.push(s);
            }
        }
        assert!(
            firsts.windows(2).all(|w| w[0] < w[1]),
            "key {key} in order after the restart: {firsts:?}"
        );
    }
}
