//! `outbox-bench console`: how long the console's pages take with a large outbox. The scratch
//! database gets `--rows` unpublished rows (a fifth keyed, over `--keys` keys) and
//! `--dead-letters` dead letters; the real `dispatcher console` binary serves it, and each page
//! is fetched `--rounds` times (after one warm-up), timed from the request to the last byte.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use harness::process::{Spawn, http_request};

use crate::binary::default_contender;
use crate::report::summary;
use crate::scratch::Scratch;

/// `console` options.
#[derive(Debug, clap::Args)]
pub struct ConsoleArgs {
    /// Unpublished rows in the outbox.
    #[arg(long, default_value_t = 1_000_000)]
    pub rows: i64,
    /// Ordering keys of the keyed fifth.
    #[arg(long, default_value_t = 10_000)]
    pub keys: i64,
    /// Dead letters.
    #[arg(long, default_value_t = 100_000)]
    pub dead_letters: i64,
    /// Fetches of each page.
    #[arg(long, default_value_t = 10)]
    pub rounds: usize,
}

/// Fills the scratch database, starts the console, times each page.
pub async fn console_bench(db: &Scratch, args: &ConsoleArgs) -> Result<()> {
    let started = Instant::now();
    sqlx::query(
        "INSERT INTO pubsub_outbox (topic, ordering_key, dedupe_key, payload, next_attempt_at)
         SELECT 'projects/outbox-bench/topics/topic-' || (g % 5),
                CASE WHEN g % 5 = 0 THEN 'key-' || (g % $2) END,
                'o-' || g, convert_to(repeat('x', 200), 'UTF8'), now() - (g % 3600) * interval '1 s'
         FROM generate_series(1, $1) g",
    )
    .bind(args.rows)
    .bind(args.keys)
    .execute(&db.pool)
    .await
    .context("filling the outbox")?;
    sqlx::query(
        "INSERT INTO pubsub_outbox_dead_letter (outbox_id, topic, ordering_key, dedupe_key, payload,
                                                created_at, failed_at, attempts, error_kind, last_error, source)
         SELECT CASE WHEN g % 10 = 0 THEN g END, 'projects/outbox-bench/topics/topic-' || (g % 5),
                CASE WHEN g % 10 = 0 THEN 'key-' || (g % $2) END,
                'd-' || g, convert_to('{\"n\": ' || g || '}', 'UTF8'), now(),
                now() - (g % 86400) * interval '1 s', 1,
                (ARRAY['permanent', 'exhausted', 'rejected'])[1 + g % 3], 'INVALID_ARGUMENT: schema', 'dispatcher'
         FROM generate_series(1, $1) g",
    )
    .bind(args.dead_letters)
    .bind(args.keys)
    .execute(&db.pool)
    .await
    .context("filling the dead-letter table")?;
    sqlx::query("VACUUM ANALYZE pubsub_outbox")
        .execute(&db.pool)
        .await?;
    sqlx::query("VACUUM ANALYZE pubsub_outbox_dead_letter")
        .execute(&db.pool)
        .await?;
    println!(
        "filled {} outbox rows and {} dead letters in {:.1} s",
        args.rows,
        args.dead_letters,
        started.elapsed().as_secs_f64()
    );
    let dispatcher = default_contender()?.path;
    let mut console = Spawn::program(&dispatcher)
        .args(["console", "--listen-addr", "127.0.0.1:0", "--actions"])
        .env("DATABASE_URL", db.db.url())
        .start()?;
    let addr = console
        .bound_addr(Duration::from_secs(30))
        .await
        .context("starting the console")?
        .to_string();
    let some_id: i64 = sqlx::query_scalar("SELECT max(id) FROM pubsub_outbox_dead_letter")
        .fetch_one(&db.pool)
        .await?;
    let pages = [
        ("overview", "/".to_owned()),
        ("dead letters", "/dead-letters".to_owned()),
        (
            "dead letters, filtered",
            "/dead-letters?topic=projects%2Foutbox-bench%2Ftopics%2Ftopic-3&kind=exhausted&error_contains=schema".to_owned(),
        ),
        ("a dead letter", format!("/dead-letters/{some_id}")),
        ("audit trail", "/audit".to_owned()),
    ];
    println!("| page | median ms | max ms |\n|---|---|---|");
    for (name, path) in &pages {
        let _ = http_request(&addr, "GET", path, &[], "").await;
        let mut times = Vec::with_capacity(args.rounds);
        for _ in 0..args.rounds {
            let t = Instant::now();
            let r = http_request(&addr, "GET", path, &[], "").await;
            if r.status != 200 {
                bail!("{path} answered {}: {}", r.status, r.body);
            }
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let s = summary(times.iter().copied());
        println!("| {name} | {:.1} | {:.1} |", s.median, s.max);
    }
    // What the overview renders is `status`, read in the background once per interval: the
    // command itself, timed as the CLI runs it.
    let mut times = Vec::with_capacity(args.rounds);
    for _ in 0..args.rounds.min(3) {
        let t = Instant::now();
        let out = Spawn::program(&dispatcher)
            .args(["status", "--json"])
            .env("DATABASE_URL", db.db.url())
            .output(Duration::from_secs(120))
            .await?;
        if !out.status.success() {
            bail!(
                "dispatcher status failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let s = summary(times.iter().copied());
    println!(
        "| `dispatcher status --json` (the overview's background read, process included) | {:.1} | {:.1} |",
        s.median, s.max
    );
    let _ = console.child.kill().await;
    Ok(())
}
