//! The claim protocol against the real database, at random (issue #49). Writer sessions insert
//! keyed and unkeyed rows in transactions that stay open from nothing to 30 s, commit or roll
//! back; some keys are written by two sessions at once. Three dispatchers publish them while
//! publishes fail at random (rows given back), poison rows are dead-lettered and replayed, and a
//! dispatcher is killed every few seconds and another started. The checker holds the promise of
//! docs/dispatcher.md ("Order"):
//! - nothing lost, nothing invented (a rolled-back row never goes out);
//! - a session's rows of a key go out in the session's order;
//! - of two rows of a key, one whose transaction committed before the other's INSERT began goes
//!   out first (rows of transactions open at the same time have no order between them).
//!
//! `OUTBOX_PROTOCOL_SEED` replays a run (the seed is printed); `OUTBOX_PROTOCOL_SECONDS` sets
//! how long the writers write (default 40). Named to run last (tests start in name order): it
//! holds about 35 of the server's connections for a minute, and the suite's first minute is its
//! busiest.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harness::db::TestDb;
use harness::dispatcher::{self as test_dispatcher, Running, real_publisher};
use harness::fixtures::{count, message};
use harness::pubsub::{TestTopic, by_publish_order};
use harness::wait::wait_until;
use outbox_dispatcher::Code;
use outbox_dispatcher::fault::{Fault, FaultInjector};
use outbox_runtime::db::DatabaseArgs;
use outbox_shared::store::dead_letter;
use sqlx::PgPool;

/// One row a session inserted.
#[derive(Debug, Clone)]
struct Row {
    dedupe: String,
    key: Option<String>,
    session: usize,
    /// The session's count of rows, in insert order.
    seq: usize,
    /// Before its INSERT was sent.
    inserted: Instant,
    /// After its COMMIT returned (None: rolled back).
    committed: Option<Instant>,
}

/// The knobs of a run, drawn from the seed where random.
#[derive(Debug, Clone, Copy)]
struct Run {
    seed: u64,
    sessions: usize,
    /// Keys of one session only, per session.
    own_keys: usize,
    /// Keys any session writes.
    shared_keys: usize,
    writing: Duration,
    /// Share of transactions held open 3-30 s.
    long: f64,
    rollback: f64,
    poison: f64,
    /// Share of publishes that fail transiently.
    flaky: f64,
    replicas: usize,
    kill_every: Duration,
}

impl Run {
    fn from_env() -> Self {
        let seed = std::env::var("OUTBOX_PROTOCOL_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| fastrand::u64(..));
        let seconds = std::env::var("OUTBOX_PROTOCOL_SECONDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(40);
        Self {
            seed,
            sessions: 10,
            own_keys: 3,
            shared_keys: 6,
            writing: Duration::from_secs(seconds),
            long: 0.08,
            rollback: 0.1,
            poison: 0.01,
            flaky: 0.03,
            replicas: 3,
            kill_every: Duration::from_secs(7),
        }
    }
}

type Log = Arc<Mutex<Vec<Row>>>;

/// One writer session until `run.writing` has passed: transactions of 1-6 rows (its own keys,
/// the shared keys, unkeyed), held open a while, then committed or rolled back.
async fn session(pool: PgPool, topic: String, run: Run, s: usize, log: Log) {
    let mut rng = fastrand::Rng::with_seed(run.seed ^ (s as u64 + 1).wrapping_mul(0x9E37_79B9));
    let start = Instant::now();
    let mut seq = 0;
    while start.elapsed() < run.writing {
        let mut conn = pool.acquire().await.expect("a session");
        let mut tx = sqlx::Connection::begin(&mut *conn).await.expect("begin");
        let mut rows = Vec::new();
        for _ in 0..rng.usize(1..=6) {
            seq += 1;
            let key = match rng.f64() {
                x if x < 0.6 => Some(format!("own-{s:02}-{}", rng.usize(0..run.own_keys))),
                x if x < 0.9 => Some(format!("shared-{}", rng.usize(0..run.shared_keys))),
                _ => None,
            };
            let dedupe = format!("s{s:02}-{seq:05}");
            let mut m = message(&topic, &dedupe, &[]);
            if let Some(k) = &key {
                m = m.with_ordering_key(k.clone());
            }
            let inserted = Instant::now();
            outbox_shared::enqueue_batch(&mut tx, std::slice::from_ref(&m))
                .await
                .expect("insert");
            rows.push(Row {
                dedupe,
                key,
                session: s,
                seq,
                inserted,
                committed: None,
            });
            tokio::time::sleep(Duration::from_millis(rng.u64(0..20))).await;
        }
        let hold = if rng.f64() < run.long {
            Duration::from_millis(rng.u64(3_000..=30_000))
        } else {
            Duration::from_millis(rng.u64(0..=300))
        };
        tokio::time::sleep(hold).await;
        if rng.f64() < run.rollback {
            tx.rollback().await.expect("rollback");
        } else {
            outbox_shared::notify(&mut tx, outbox_shared::DEFAULT_NOTIFY_CHANNEL)
                .await
                .expect("notify");
            tx.commit().await.expect("commit");
            let at = Instant::now();
            for r in &mut rows {
                r.committed = Some(at);
            }
        }
        log.lock().expect("log").extend(rows);
    }
}

/// Whether the row with `dedupe` is poison (drawn from the seed and the dedupe key, so every
/// replica knows before it is written).
fn is_poison(run: &Run, dedupe: &str) -> bool {
    let mut rng = fastrand::Rng::with_seed(
        dedupe
            .bytes()
            .fold(run.seed, |h, b| h.rotate_left(7) ^ u64::from(b)),
    );
    rng.f64() < run.poison
}

/// Every dedupe key a session may write (`s<session>-<seq>`), far more than it will.
fn every_dedupe(run: &Run) -> impl Iterator<Item = String> {
    (0..run.sessions).flat_map(|s| (1..=20_000).map(move |seq| format!("s{s:02}-{seq:05}")))
}

/// A dispatcher whose publishes fail transiently at `run.flaky` (rows given back), and whose
/// poison rows are refused on their first two publishes (the batch, then alone):
/// dead-lettered, then replayed by the test.
async fn replica(db: &TestDb, run: Run) -> Running {
    let publisher = FaultInjector::new(real_publisher().await, run.flaky, Code::Unavailable);
    for dedupe in every_dedupe(&run).filter(|d| is_poison(&run, d)) {
        publisher.fail(
            &dedupe,
            Fault {
                code: Code::InvalidArgument,
                times: Some(2),
            },
        );
    }
    let mut config = test_dispatcher::config();
    config.workers = 2;
    config.batch.schedule.max_attempts = 8;
    // A small pool (the workers, the listener and the background tasks): the run shares the
    // server's connections with the tests beside it.
    let args = DatabaseArgs {
        pool_size: 5,
        ..DatabaseArgs::for_url(db.url())
    };
    let pool = outbox_dispatcher::connect_database(&args, &config)
        .await
        .expect("the dispatcher's pool connects");
    let d = outbox_dispatcher::Dispatcher::build(config, pool, publisher)
        .await
        .expect("the dispatcher builds");
    Running::start(d)
}

#[tokio::test]
async fn the_claim_protocol_keeps_each_keys_order_whatever_the_writers_and_the_replicas_do() {
    let run = Run::from_env();
    println!("claim protocol run: seed {} ({run:?})", run.seed);
    let db = TestDb::new().await;
    let topic = TestTopic::new(true).await;
    let log: Log = Arc::default();
    let writers: Vec<_> = (0..run.sessions)
        .map(|s| {
            tokio::spawn(session(
                db.pool.clone(),
                topic.topic.clone(),
                run,
                s,
                log.clone(),
            ))
        })
        .collect();
    let mut rng = fastrand::Rng::with_seed(run.seed);
    let mut replicas = Vec::new();
    for _ in 0..run.replicas {
        replicas.push(replica(&db, run).await);
    }
    let (mut kills, mut replays) = (0, 0);
    let started = Instant::now();
    let mut next_kill = started + run.kill_every;
    while writers.iter().any(|w| !w.is_finished()) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        replays += replay_dead_letters(&db.pool).await;
        if Instant::now() >= next_kill {
            let victim = rng.usize(0..replicas.len());
            replicas.swap_remove(victim).abort();
            kills += 1;
            replicas.push(replica(&db, run).await);
            next_kill += run.kill_every;
        }
    }
    for w in writers {
        w.await.expect("a writer session");
    }
    // A killed replica's connections went with it (the writers' are back in their pool).
    let sessions = count(
        &db.pool,
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()",
    )
    .await;
    assert!(
        sessions <= (20 + 5 * run.replicas) as i64,
        "{sessions} sessions on the database after {kills} kills: a killed replica kept its connections"
    );
    wait_until(
        "the outbox and the dead letters drain (replayed as they come)",
        Duration::from_secs(180),
        || {
            let pool = db.pool.clone();
            async move {
                let replayed = replay_dead_letters(&pool).await;
                let left: i64 = sqlx::query_scalar(
                    "SELECT (SELECT count(*) FROM pubsub_outbox)
                          + (SELECT count(*) FROM pubsub_outbox_dead_letter)",
                )
                .fetch_one(&pool)
                .await
                .map_err(|e| e.to_string())?;
                if left == 0 && replayed == 0 {
                    Ok(())
                } else {
                    Err(format!("{left} rows left"))
                }
            }
        },
    )
    .await;
    for r in replicas {
        r.stop().await;
    }

    let rows = log.lock().expect("log").clone();
    let committed: Vec<&Row> = rows.iter().filter(|r| r.committed.is_some()).collect();
    // Until nothing came for 5 s: duplicates count among the arrivals, so their number says
    // nothing of whether every row arrived.
    let received = by_publish_order(&topic.pull(usize::MAX, Duration::from_secs(5)).await);
    let mut first: HashMap<&str, usize> = HashMap::new();
    for (i, m) in received.iter().enumerate() {
        first.entry(m.dedupe_key()).or_insert(i);
    }
    let poison = committed
        .iter()
        .filter(|r| is_poison(&run, &r.dedupe))
        .count();
    let long = rows
        .iter()
        .filter(|r| {
            r.committed
                .is_some_and(|c| c - r.inserted > Duration::from_secs(3))
        })
        .count();
    println!(
        "seed {}: {} rows committed ({} open over 3 s before their commit, {} poison), {} rolled back, {} arrivals ({} duplicates), {} dispatcher kills, {} dead letters replayed",
        run.seed,
        committed.len(),
        long,
        poison,
        rows.len() - committed.len(),
        received.len(),
        received.len().saturating_sub(first.len()),
        kills,
        replays
    );
    let lost: Vec<&str> = committed
        .iter()
        .filter(|r| !first.contains_key(r.dedupe.as_str()))
        .map(|r| r.dedupe.as_str())
        .collect();
    assert!(lost.is_empty(), "seed {}: lost {lost:?}", run.seed);
    let invented: Vec<&str> = first
        .keys()
        .filter(|d| !committed.iter().any(|r| r.dedupe == **d))
        .copied()
        .collect();
    assert!(
        invented.is_empty(),
        "seed {}: arrived, never committed (rolled back?): {invented:?}",
        run.seed
    );
    let broken = order_breaks(&committed, &first);
    assert!(
        broken.is_empty(),
        "seed {}: {} order breaks, first: {:?}",
        run.seed,
        broken.len(),
        &broken[..broken.len().min(5)]
    );
}

/// Replays every dead letter there is; returns how many.
async fn replay_dead_letters(pool: &PgPool) -> usize {
    let Ok(mut conn) = pool.acquire().await else {
        return 0;
    };
    let dead = dead_letter::list(&mut conn, None, 1_000)
        .await
        .expect("list dead letters");
    if dead.is_empty() {
        return 0;
    }
    let ids: Vec<i64> = dead.iter().map(|d| d.id).collect();
    dead_letter::replay(&mut conn, &ids)
        .await
        .expect("replay")
        .len()
}

/// Pairs of rows of one key that went out against the promise: (the one that should have gone
/// first, the one that went first, why).
fn order_breaks(
    committed: &[&Row],
    first: &HashMap<&str, usize>,
) -> Vec<(String, String, &'static str)> {
    let mut by_key: HashMap<&str, Vec<&Row>> = HashMap::new();
    for r in committed {
        if let Some(k) = &r.key {
            by_key.entry(k).or_default().push(r);
        }
    }
    let mut broken = Vec::new();
    for rows in by_key.values() {
        for a in rows {
            for b in rows {
                let (Some(pa), Some(pb)) =
                    (first.get(a.dedupe.as_str()), first.get(b.dedupe.as_str()))
                else {
                    continue;
                };
                if pa < pb {
                    continue;
                }
                let same_session = a.session == b.session && a.seq < b.seq;
                let before = a.committed.is_some_and(|c| c < b.inserted);
                if same_session || before {
                    let why = if same_session {
                        "one session's order"
                    } else {
                        "committed before the other's insert"
                    };
                    broken.push((a.dedupe.clone(), b.dedupe.clone(), why));
                }
            }
        }
    }
    broken
}
