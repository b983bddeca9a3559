//! Every operator change goes through its whole selection, whatever `--batch-size` (issue #51):
//! at random selections (ids, a filter, both) and batch sizes, for `pending retry-now`,
//! `pending cancel`, `dead-letters replay` and `dead-letters discard` run by the real binary, the
//! dry run's ids = the real run's ids = the ids the audit recorded = what the selection names.
//! `OUTBOX_CHANGE_SEED` replays a run.

use std::collections::BTreeSet;

use serde_json::Value;

use harness::db::TestDb;
use harness::fixtures::{enqueue, message};
use harness::operator::{dispatcher, json};

const TOPIC: &str = "projects/test-project/topics/changes";

/// A random selection of `pool` (all of the round's rows or entries): by ids, by the round's
/// dedupe prefix, or both; with the ids it must change.
fn select(rng: &mut fastrand::Rng, pool: &[i64], prefix: &str) -> (Vec<String>, BTreeSet<i64>) {
    let mut chosen: Vec<i64> = pool.iter().copied().filter(|_| rng.bool()).collect();
    if chosen.is_empty() {
        chosen.push(pool[rng.usize(..pool.len())]);
    }
    let ids = || chosen.iter().map(i64::to_string).collect::<Vec<_>>();
    match rng.u8(0..3) {
        0 => (ids(), chosen.iter().copied().collect()),
        1 => (
            vec!["--dedupe-prefix".into(), prefix.to_owned(), "--yes".into()],
            pool.iter().copied().collect(),
        ),
        _ => {
            let mut args = ids();
            args.extend(["--dedupe-prefix".into(), prefix.to_owned()]);
            (args, chosen.iter().copied().collect())
        }
    }
}

/// Batch sizes that cut selections into many pages, and now and then one that does not.
fn batch_size(rng: &mut fastrand::Rng) -> i64 {
    if rng.u8(0..4) == 0 {
        rng.i64(1..=1000)
    } else {
        rng.i64(1..=7)
    }
}

fn ids(v: &Value) -> BTreeSet<i64> {
    v["ids"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_i64).collect())
        .unwrap_or_default()
}

/// The row ids the audit recorded for `action` in entries after `after`.
async fn audited(db: &TestDb, action: &str, after: i64) -> (Vec<i64>, i64) {
    let rows: Vec<(i64, Vec<i64>)> = sqlx::query_as(
        "SELECT id, row_ids FROM pubsub_outbox_audit WHERE action = $1 AND id > $2 ORDER BY id",
    )
    .bind(action)
    .bind(after)
    .fetch_all(&db.pool)
    .await
    .expect("read the audit");
    let last = rows.last().map_or(after, |r| r.0);
    (rows.into_iter().flat_map(|r| r.1).collect(), last)
}

/// One change: `group verb args… --batch-size N`, and the ids it must change.
struct Case<'a> {
    verb: (&'a str, &'a str),
    action: &'a str,
    args: Vec<String>,
    batch: i64,
    expected: BTreeSet<i64>,
}

/// Runs the case as a dry run and for real; checks both against its ids and the audit entries
/// written after `audit_after`; returns the ids changed.
async fn change(
    db: &TestDb,
    c: &Case<'_>,
    audit_after: &mut i64,
    seed: u64,
    round: usize,
) -> BTreeSet<i64> {
    let case = format!(
        "seed {seed} round {round}: {} {} {:?} --batch-size {}",
        c.verb.0, c.verb.1, c.args, c.batch
    );
    let (verb, action, args, expected) = (c.verb, c.action, &c.args, &c.expected);
    let batch = c.batch.to_string();
    let mut common: Vec<&str> = vec![verb.0, verb.1];
    common.extend(args.iter().map(String::as_str));
    common.extend(["--batch-size", &batch, "--json"]);
    let mut dry_args = common.clone();
    dry_args.push("--dry-run");
    let dry = json(db, &dry_args);
    let mut real_args = common.clone();
    real_args.extend(["--reason", "property test"]);
    let real = json(db, &real_args);
    let (recorded, last) = audited(db, action, *audit_after).await;
    *audit_after = last;
    let recorded_set: BTreeSet<i64> = recorded.iter().copied().collect();
    assert_eq!(
        ids(&dry),
        *expected,
        "{case}: the dry run lists the selection"
    );
    assert_eq!(ids(&real), *expected, "{case}: the real run changes it all");
    assert_eq!(
        recorded.len(),
        expected.len(),
        "{case}: the audit counts each once"
    );
    assert_eq!(recorded_set, *expected, "{case}: the audit names them");
    ids(&real)
}

#[tokio::test]
async fn a_change_by_ids_or_filter_goes_through_its_whole_selection_at_every_batch_size() {
    let seed = std::env::var("OUTBOX_CHANGE_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    println!("operator changes: OUTBOX_CHANGE_SEED={seed}");
    let mut rng = fastrand::Rng::with_seed(seed);
    let db = TestDb::new().await;
    let mut audit_after = 0;
    for round in 0..8 {
        let prefix = format!("r{round}-");
        let n = rng.usize(5..=40);
        let rows: Vec<_> = (0..n)
            .map(|i| message(TOPIC, &format!("{prefix}{i:03}"), &[]))
            .collect();
        enqueue(&db.pool, &rows).await;
        // Waiting (a retry an hour ahead), as `retry-now` selects.
        let outbox: Vec<i64> = sqlx::query_scalar(
            "UPDATE pubsub_outbox SET next_attempt_at = now() + interval '1 hour', attempts = 1
             WHERE starts_with(dedupe_key, $1) RETURNING id",
        )
        .bind(&prefix)
        .fetch_all(&db.pool)
        .await
        .expect("the rows wait");
        let mut outbox = outbox;
        outbox.sort_unstable();

        let (args, expected) = select(&mut rng, &outbox, &prefix);
        let c = Case {
            verb: ("pending", "retry-now"),
            action: "retry-now",
            args,
            batch: batch_size(&mut rng),
            expected,
        };
        change(&db, &c, &mut audit_after, seed, round).await;

        let (args, expected) = select(&mut rng, &outbox, &prefix);
        let c = Case {
            verb: ("pending", "cancel"),
            action: "cancel",
            args,
            batch: batch_size(&mut rng),
            expected,
        };
        let cancelled = change(&db, &c, &mut audit_after, seed, round).await;

        // The cancelled messages' dead letters, by their own ids.
        let letters: Vec<i64> = sqlx::query_scalar(
            "SELECT id FROM pubsub_outbox_dead_letter WHERE outbox_id = ANY($1) ORDER BY id",
        )
        .bind(cancelled.iter().copied().collect::<Vec<_>>())
        .fetch_all(&db.pool)
        .await
        .expect("the dead letters");
        assert_eq!(letters.len(), cancelled.len());
        let (args, expected) = select(&mut rng, &letters, &prefix);
        let c = Case {
            verb: ("dead-letters", "replay"),
            action: "replay",
            args,
            batch: batch_size(&mut rng),
            expected,
        };
        let replayed = change(&db, &c, &mut audit_after, seed, round).await;

        let left: Vec<i64> = letters
            .iter()
            .copied()
            .filter(|id| !replayed.contains(id))
            .collect();
        if left.is_empty() {
            continue;
        }
        let (args, expected) = select(&mut rng, &left, &prefix);
        let c = Case {
            verb: ("dead-letters", "discard"),
            action: "discard",
            args,
            batch: batch_size(&mut rng),
            expected,
        };
        change(&db, &c, &mut audit_after, seed, round).await;
    }
    // Nothing is left half-done: the outbox and the dead letters hold what the changes left.
    let (code, _, err) = dispatcher(&db, &["status"]);
    assert_eq!(code, 0, "{err}");
}
