//! The figures of a run: what the load and the faults were, what the verdict found, recovery
//! times, the outbox's health; printed as a table with one summary line last, and as JSON. A run
//! passes only with nothing lost, nothing invented, no order broken, exactly the expected dead
//! letters, the held keys intact, no due row left, the watermark at the newest source row, every
//! planned fault executed, no dispatcher exiting by itself, and every key the application topic
//! delivered applied exactly once by the inbox consumer.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use harness::ledger::Verdict;
use serde_json::{Value, json};
use sqlx::PgPool;

use crate::faults::FaultRecord;
use crate::inbox::InboxFigures;
use crate::load::Expected;
use crate::plan::Plan;
use crate::verdict::{self, Attribution, Rec};

/// A producer cursor: (timestamp micros, tie-breaker).
pub type Cursor = (i64, String);

/// The outbox table's size and dead tuples.
#[derive(Debug, Clone, Default)]
pub struct TableHealth {
    pub live_tuples: i64,
    pub dead_tuples: i64,
    pub bytes: i64,
}

pub async fn table_health(pool: &PgPool) -> Result<TableHealth> {
    let (live_tuples, dead_tuples, bytes): (i64, i64, i64) = sqlx::query_as(
        "SELECT n_live_tup, n_dead_tup, pg_total_relation_size('pubsub_outbox')
         FROM pg_stat_user_tables WHERE relname = 'pubsub_outbox'",
    )
    .fetch_one(pool)
    .await?;
    Ok(TableHealth {
        live_tuples,
        dead_tuples,
        bytes,
    })
}

#[derive(Debug, Default)]
pub struct Report {
    pub mode: &'static str,
    pub seed: u64,
    pub planned: BTreeMap<&'static str, usize>,
    pub app_rows: usize,
    pub bigquery_rows: usize,
    pub unpublishable: usize,
    pub publishable: usize,
    pub retried_transactions: usize,
    pub long_writes: usize,
    pub longest_write: Duration,
    pub arrival: Verdict,
    pub publish: Verdict,
    pub attribution: Attribution,
    pub faults: Vec<(FaultRecord, Option<Duration>)>,
    pub dead_expected: usize,
    pub dead_found: usize,
    pub dead_missing: Vec<String>,
    pub dead_unexpected: Vec<String>,
    pub held_keys: usize,
    pub held_rows: usize,
    pub discarded: usize,
    pub due_at_end: i64,
    /// The producer's watermark: (newest source row, stored).
    pub watermark: (Option<Cursor>, Option<Cursor>),
    pub dispatcher_starts: usize,
    pub unexpected_exits: Vec<String>,
    pub terminate_failures: Vec<String>,
    /// Producer executions: (succeeded, failed, killed).
    pub producer_outcomes: (usize, usize, usize),
    pub producer_abandoned: i64,
    pub health_before: TableHealth,
    pub health_peak: TableHealth,
    pub health_after: TableHealth,
    pub drain: Duration,
    pub wall: Duration,
    /// The inbox consumer of the application topic (set before [`Report::judge`]).
    pub inbox: InboxFigures,
    pub failures: Vec<String>,
}

impl Report {
    pub fn new(plan: &Plan) -> Self {
        let mut planned = BTreeMap::new();
        for (_, f) in &plan.faults {
            *planned.entry(f.kind()).or_insert(0) += 1;
        }
        Self {
            mode: plan.mode.name(),
            seed: plan.seed,
            planned,
            ..Self::default()
        }
    }

    /// The verdict on the arrivals, and every check that can fail the run.
    pub fn judge(&mut self, e: &Expected, arrivals: &[Rec], faults: Vec<FaultRecord>) {
        self.app_rows = e.app_rows;
        self.bigquery_rows = e.bigquery_rows;
        self.unpublishable = e.dead.len();
        self.publishable = e.ledger.len();
        self.retried_transactions = e.retried_transactions;
        self.long_writes = e.long_writes;
        self.longest_write = e.longest_write;
        (self.arrival, self.publish) = verdict::judge(&e.ledger, arrivals);
        self.attribution = verdict::attribute_duplicates(arrivals, &faults);
        let mut times: Vec<Duration> = arrivals.iter().map(|r| r.at).collect();
        times.sort();
        self.faults = faults
            .into_iter()
            .map(|f| {
                let r = verdict::recovery(&times, &f);
                (f, r)
            })
            .collect();

        let f = &mut self.failures;
        if !self.arrival.lost.is_empty() {
            f.push(format!(
                "{} lost (first: {:?})",
                self.arrival.lost.len(),
                &self.arrival.lost[..self.arrival.lost.len().min(5)]
            ));
        }
        if !self.arrival.invented.is_empty() {
            f.push(format!(
                "{} invented (first: {:?})",
                self.arrival.invented.len(),
                &self.arrival.invented[..self.arrival.invented.len().min(5)]
            ));
        }
        for (what, v) in [("arrival", &self.arrival), ("publish", &self.publish)] {
            if let Some(first) = v.order_violations.first() {
                f.push(format!(
                    "{} order violations in {what} order (first: {first:?})",
                    v.order_violations.len()
                ));
            }
        }
        if !self.dead_missing.is_empty() || !self.dead_unexpected.is_empty() {
            f.push(format!(
                "dead letters: {} expected missing (first: {:?}), {} unexpected (first: {:?})",
                self.dead_missing.len(),
                self.dead_missing.first(),
                self.dead_unexpected.len(),
                self.dead_unexpected.first()
            ));
        }
        if self.due_at_end != 0 {
            f.push(format!("{} due rows left in the outbox", self.due_at_end));
        }
        if self.watermark.0 != self.watermark.1 {
            f.push(format!(
                "producer watermark {:?}, newest source row {:?}",
                self.watermark.1, self.watermark.0
            ));
        }
        for u in self.unexpected_exits.iter().chain(&self.terminate_failures) {
            f.push(u.clone());
        }
        for (kind, n) in &self.planned {
            let done = self.faults.iter().filter(|(r, _)| r.kind == *kind).count();
            if done < *n {
                f.push(format!("{kind}: {done} of {n} planned executed"));
            }
        }
        f.extend(self.inbox.failures());
    }

    pub fn passed(&self) -> bool {
        self.failures.is_empty()
    }

    fn count(&self, kind: &str) -> usize {
        self.faults.iter().filter(|(r, _)| r.kind == kind).count()
    }

    fn kills_in_flight(&self) -> usize {
        self.faults
            .iter()
            .filter(|(r, _)| r.hit_in_flight == Some(true))
            .count()
    }

    fn recoveries(&self, kind: &str) -> Vec<u128> {
        self.faults
            .iter()
            .filter(|(r, _)| r.kind == kind)
            .filter_map(|(_, d)| d.map(|d| d.as_millis()))
            .collect()
    }

    pub fn json(&self) -> Value {
        let faults: Vec<Value> = self
            .faults
            .iter()
            .map(|(r, rec)| {
                json!({
                    "kind": r.kind, "at_ms": r.at.as_millis() as u64,
                    "healed_ms": r.healed.as_millis() as u64, "detail": r.detail,
                    "hit_in_flight": r.hit_in_flight,
                    "recovery_ms": rec.map(|d| d.as_millis() as u64),
                })
            })
            .collect();
        let i = &self.inbox;
        let health = |h: &TableHealth| json!({"live_tuples": h.live_tuples, "dead_tuples": h.dead_tuples, "bytes": h.bytes});
        json!({
            "mode": self.mode, "seed": self.seed, "passed": self.passed(),
            "rows": {"total": self.app_rows + self.bigquery_rows, "application": self.app_rows,
                     "bigquery": self.bigquery_rows, "unpublishable": self.unpublishable,
                     "publishable": self.publishable,
                     "application_transactions_retried": self.retried_transactions,
                     "long_writer_transactions": self.long_writes,
                     "longest_writer_transaction_ms": self.longest_write.as_millis() as u64},
            "arrivals": self.arrival.arrivals,
            "lost": self.arrival.lost.len(), "invented": self.arrival.invented.len(),
            "duplicates": self.arrival.duplicates,
            "duplicates_by_cause": {"pubsub_redelivery": self.attribution.redelivered,
                "dispatcher_kill": self.attribution.kill,
                "postgres_restart": self.attribution.postgres_restart,
                "pubsub_outage": self.attribution.outage, "unattributed": self.attribution.other},
            "order_violations": {"arrival_order": self.arrival.order_violations.len(),
                                 "publish_order": self.publish.order_violations.len()},
            "dead_letters": {"expected": self.dead_expected, "found": self.dead_found,
                "missing": self.dead_missing.len(), "unexpected": self.dead_unexpected.len(),
                "keyed_discarded_at_end": self.discarded},
            "held_keys": {"keys": self.held_keys, "rows_held": self.held_rows},
            "due_rows_at_end": self.due_at_end,
            "watermark": {"expected": self.watermark.0, "found": self.watermark.1},
            "faults": faults,
            "kills": {"dispatcher": self.count("dispatcher_kill"),
                      "dispatcher_in_flight": self.kills_in_flight(),
                      "producer": self.count("producer_kill")},
            "outages": {"cut": self.count("pubsub_cut"), "stall": self.count("pubsub_stall")},
            "postgres_restarts": self.count("postgres_restart"),
            "dispatcher_starts": self.dispatcher_starts,
            "unexpected_dispatcher_exits": self.unexpected_exits,
            "producer_runs": {"succeeded": self.producer_outcomes.0, "failed": self.producer_outcomes.1,
                              "killed": self.producer_outcomes.2, "abandoned_rows": self.producer_abandoned},
            "outbox_table": {"before": health(&self.health_before), "peak": health(&self.health_peak),
                             "after": health(&self.health_after)},
            "inbox": {"delivered_keys": i.delivered, "applied_keys": i.applied,
                "missing": i.missing.len(), "extra": i.extra.len(),
                "applied_more_than_once": i.over_once.len(), "inbox_rows": i.inbox_rows,
                "processed": i.counters.processed, "duplicates_dropped": i.counters.duplicates,
                "failures": i.counters.failures, "consumer_starts": i.starts,
                "kills": i.kills.iter().map(|(at, n)| json!({"at_s": at, "processed_before": n}))
                    .collect::<Vec<_>>(),
                "catch_up_seconds": i.catch_up.as_secs_f64()},
            "drain_seconds": self.drain.as_secs_f64(),
            "wall_seconds": self.wall.as_secs_f64(),
            "failures": self.failures,
        })
    }

    pub fn print(&self, json_path: &Path) {
        let rows = self.app_rows + self.bigquery_rows;
        println!("\nfaults (time since load start, recovery = first delivery after the heal):");
        for (r, rec) in &self.faults {
            println!(
                "  {:>7.1}s  {:<18} healed {:>7.1}s  recovery {:>7}  {}{}",
                r.at.as_secs_f64(),
                r.kind,
                r.healed.as_secs_f64(),
                rec.map_or("-".to_owned(), |d| format!("{} ms", d.as_millis())),
                r.detail,
                match r.hit_in_flight {
                    Some(true) => ", a batch in flight",
                    Some(false) => ", idle",
                    None => "",
                }
            );
        }
        let mb = |b: i64| b as f64 / 1_048_576.0;
        let a = &self.attribution;
        println!("\nfigures:");
        println!(
            "  rows               {rows} ({} application, {} BigQuery; {} unpublishable; {} application transactions retried)",
            self.app_rows, self.bigquery_rows, self.unpublishable, self.retried_transactions
        );
        println!(
            "  long writers       {} application transactions held open after their inserts (longest {:.1} s)",
            self.long_writes,
            self.longest_write.as_secs_f64()
        );
        println!(
            "  kills              {} dispatcher ({} with a batch in flight), {} producer ({} runs abandoned)",
            self.count("dispatcher_kill"),
            self.kills_in_flight(),
            self.count("producer_kill"),
            self.producer_abandoned
        );
        println!(
            "  outages            {} cut, {} stall; {} PostgreSQL restarts; {} long transactions; {} pause/resume; {} replays",
            self.count("pubsub_cut"),
            self.count("pubsub_stall"),
            self.count("postgres_restart"),
            self.count("long_transaction"),
            self.count("pause_resume"),
            self.count("dead_letter_replay")
        );
        println!(
            "  recovery (ms)      kill {:?}, cut {:?}, stall {:?}, restart {:?}",
            self.recoveries("dispatcher_kill"),
            self.recoveries("pubsub_cut"),
            self.recoveries("pubsub_stall"),
            self.recoveries("postgres_restart")
        );
        println!(
            "  arrivals           {} ({} duplicates: {} redelivered by Pub/Sub; republished: {} at kills, {} at restarts, {} at outages, {} unattributed)",
            self.arrival.arrivals,
            self.arrival.duplicates,
            a.redelivered,
            a.kill,
            a.postgres_restart,
            a.outage,
            a.other
        );
        println!(
            "  lost / invented    {} / {}",
            self.arrival.lost.len(),
            self.arrival.invented.len()
        );
        println!(
            "  order violations   {} in arrival order, {} in publish order",
            self.arrival.order_violations.len(),
            self.publish.order_violations.len()
        );
        println!(
            "  dead letters       {} of {} expected ({} missing, {} unexpected); {} keys held {} rows behind them until discarded",
            self.dead_found,
            self.dead_expected,
            self.dead_missing.len(),
            self.dead_unexpected.len(),
            self.held_keys,
            self.held_rows
        );
        println!(
            "  outbox             {} due rows at end; dead tuples {} -> peak {} -> {}; size {:.1} -> {:.1} MiB",
            self.due_at_end,
            self.health_before.dead_tuples,
            self.health_peak.dead_tuples,
            self.health_after.dead_tuples,
            mb(self.health_before.bytes),
            mb(self.health_after.bytes)
        );
        println!(
            "  producer           {} runs succeeded, {} failed, {} killed; watermark {}",
            self.producer_outcomes.0,
            self.producer_outcomes.1,
            self.producer_outcomes.2,
            if self.watermark.0 == self.watermark.1 {
                "= newest source row"
            } else {
                "WRONG"
            }
        );
        println!(
            "  dispatchers        {} processes started, {} exited by themselves",
            self.dispatcher_starts,
            self.unexpected_exits.len()
        );
        let i = &self.inbox;
        println!(
            "  inbox consumer     {} of {} delivered keys applied once ({} missing, {} extra, {} more than once; {} inbox rows); processed {}, duplicates dropped {}, failures {}; {} kills, {} starts; caught up {:.1} s after the drain",
            i.applied - i.over_once.len().min(i.applied),
            i.delivered,
            i.missing.len(),
            i.extra.len(),
            i.over_once.len(),
            i.inbox_rows,
            i.counters.processed,
            i.counters.duplicates,
            i.counters.failures,
            i.kills.len(),
            i.starts,
            i.catch_up.as_secs_f64()
        );
        println!(
            "  wall time          {:.0} s (drain {:.0} s); JSON: {}",
            self.wall.as_secs_f64(),
            self.drain.as_secs_f64(),
            json_path.display()
        );
        for f in &self.failures {
            println!("  FAILED: {f}");
        }
        println!(
            "chaos {} seed={}: {} rows={rows} lost={} invented={} duplicates={} order_violations={} dead_letters={}/{} kills={} outages={}+{} pg_restarts={} inbox_once={}/{} wall={:.0}s",
            self.mode,
            self.seed,
            if self.passed() { "PASS" } else { "FAIL" },
            self.arrival.lost.len(),
            self.arrival.invented.len(),
            self.arrival.duplicates,
            self.arrival.order_violations.len() + self.publish.order_violations.len(),
            self.dead_found,
            self.dead_expected,
            self.count("dispatcher_kill"),
            self.count("pubsub_cut"),
            self.count("pubsub_stall"),
            self.count("postgres_restart"),
            i.applied - i.over_once.len().min(i.applied),
            i.delivered,
            self.wall.as_secs_f64()
        );
    }
}
