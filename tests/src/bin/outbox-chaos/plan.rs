//! What a run does: the sizes of a mode and the seeded fault schedule. Everything random in a run
//! (fault times, victims, which rows are unpublishable) comes from the seed, so `--seed` replays
//! the same schedule; what the verdict says must not depend on it.

use std::time::Duration;

/// Short (CI) or long (by hand).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Short,
    Long,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Short => "short",
            Mode::Long => "long",
        }
    }
}

/// One fault, at a moment of the load.
#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// SIGKILL dispatcher `victim` (0-based), restart it after `down`.
    KillDispatcher { victim: usize, down: Duration },
    /// SIGKILL a producer execution mid-run; the schedule reruns it.
    KillProducer,
    /// The proxy refuses and cuts every Pub/Sub connection for this long.
    CutPubsub(Duration),
    /// The proxy silently holds everything for this long.
    StallPubsub(Duration),
    /// `pg_ctl restart -m fast` of the private cluster.
    RestartPostgres,
    /// A transaction holding a snapshot (the vacuum horizon) for this long.
    LongTransaction(Duration),
    /// `dispatcher pause` of the application topic, `dispatcher resume` after this long.
    PauseTopic(Duration),
    /// `dispatcher dead-letters replay` of one dead letter (it is unpublishable: it comes back).
    ReplayDeadLetter,
}

impl Fault {
    pub fn kind(&self) -> &'static str {
        match self {
            Fault::KillDispatcher { .. } => "dispatcher_kill",
            Fault::KillProducer => "producer_kill",
            Fault::CutPubsub(_) => "pubsub_cut",
            Fault::StallPubsub(_) => "pubsub_stall",
            Fault::RestartPostgres => "postgres_restart",
            Fault::LongTransaction(_) => "long_transaction",
            Fault::PauseTopic(_) => "pause_resume",
            Fault::ReplayDeadLetter => "dead_letter_replay",
        }
    }
}

/// The sizes of a run and its schedule.
#[derive(Debug, Clone)]
pub struct Plan {
    pub mode: Mode,
    pub seed: u64,
    /// Source rows in all (applications and BigQuery, unpublishable ones included).
    pub rows: usize,
    /// How long the rows keep coming; every fault starts within it.
    pub load: Duration,
    /// Share of the rows that come from BigQuery through the producer.
    pub bigquery_share: f64,
    /// Ordering keys of the application topic, the schema topic and the BigQuery stream.
    pub app_keys: usize,
    pub schema_keys: usize,
    pub bigquery_keys: usize,
    /// Keys per topic that get one unpublishable row (and are held behind it).
    pub poison_keys: usize,
    /// Share of unkeyed rows that are unpublishable.
    pub bad_unkeyed: f64,
    /// Concurrent application writers (each owns a share of the keys).
    pub writers: usize,
    /// Share of the application transactions kept open after their inserts, for a time drawn
    /// from `long_write` (issue #49: longer than the claim floor margin), before they commit.
    pub long_writes: f64,
    /// How long such a transaction stays open: at least, at most.
    pub long_write: (Duration, Duration),
    pub dispatchers: usize,
    pub workers: usize,
    pub batch_size: usize,
    /// Producer executions start this often (one at a time).
    pub producer_every: Duration,
    /// Timed faults, in time order: (offset from the load's start, fault).
    pub faults: Vec<(Duration, Fault)>,
    /// Times the inbox consumer is aborted and restarted (`--inbox-kills`; default none: the
    /// emulator never ends a dropped stream, docs/testing.md, "Chaos").
    pub inbox_kills: usize,
    kills: usize,
    producer_kills: usize,
    outages: usize,
    outage: Duration,
    pg_restarts: usize,
    long_tx: Duration,
}

impl Plan {
    pub fn new(mode: Mode, seed: u64) -> Self {
        let base = Plan {
            mode,
            seed,
            rows: 20_000,
            load: Duration::from_secs(100),
            bigquery_share: 0.2,
            app_keys: 300,
            schema_keys: 60,
            bigquery_keys: 50,
            poison_keys: 2,
            bad_unkeyed: 0.002,
            writers: 6,
            long_writes: 0.01,
            long_write: (Duration::from_secs(6), Duration::from_secs(12)),
            dispatchers: 3,
            workers: 4,
            batch_size: 200,
            producer_every: Duration::from_secs(2),
            faults: Vec::new(),
            inbox_kills: 0,
            kills: 4,
            producer_kills: 1,
            outages: 1,
            outage: Duration::from_secs(10),
            pg_restarts: 1,
            long_tx: Duration::from_secs(15),
        };
        match mode {
            Mode::Short => base,
            Mode::Long => Plan {
                rows: 1_000_000,
                load: Duration::from_secs(600),
                app_keys: 500,
                schema_keys: 100,
                bad_unkeyed: 0.0002,
                batch_size: 500,
                kills: 24,
                producer_kills: 2,
                outages: 2,
                outage: Duration::from_secs(25),
                pg_restarts: 2,
                long_tx: Duration::from_secs(60),
                long_writes: 0.002,
                long_write: (Duration::from_secs(6), Duration::from_secs(30)),
                ..base
            },
        }
    }

    /// Draws the fault schedule from the seed: the exclusive faults (outages, restarts, the long
    /// transaction, the producer kill, operator actions) each in a slot of their own within 10-85 %
    /// of the load, so each one's recovery can be measured; dispatcher kills anywhere in 5-90 %.
    pub fn schedule(&mut self) {
        let mut rng = fastrand::Rng::with_seed(self.seed);
        let mut exclusive = Vec::new();
        for _ in 0..self.outages {
            exclusive.push(Fault::CutPubsub(self.outage));
            exclusive.push(Fault::StallPubsub(self.outage));
        }
        for _ in 0..self.pg_restarts {
            exclusive.push(Fault::RestartPostgres);
        }
        for _ in 0..self.producer_kills {
            exclusive.push(Fault::KillProducer);
        }
        exclusive.push(Fault::LongTransaction(self.long_tx));
        exclusive.push(Fault::PauseTopic(Duration::from_secs(5)));
        exclusive.push(Fault::ReplayDeadLetter);
        rng.shuffle(&mut exclusive);
        // One after the other within 10-85 % of the load, each followed by at least 4 s without an
        // exclusive fault (its recovery), the spare time spread over the gaps at random.
        let load = self.load.as_secs_f64();
        let (from, to) = (0.10 * load, 0.85 * load);
        let length = |f: &Fault| match f {
            Fault::CutPubsub(d)
            | Fault::StallPubsub(d)
            | Fault::LongTransaction(d)
            | Fault::PauseTopic(d) => d.as_secs_f64(),
            _ => 1.0,
        };
        let min_gap = 4.0;
        let busy: f64 = exclusive.iter().map(|f| length(f) + min_gap).sum();
        let spare = (to - from - busy).max(0.0);
        let weights: Vec<f64> = exclusive.iter().map(|_| rng.f64() + 0.1).collect();
        let total: f64 = weights.iter().sum();
        let mut faults: Vec<(Duration, Fault)> = Vec::new();
        let mut at = from;
        for (f, w) in exclusive.into_iter().zip(weights) {
            at += spare * w / total;
            let next = at + length(&f) + min_gap;
            faults.push((Duration::from_secs_f64(at), f));
            at = next;
        }
        for _ in 0..self.kills {
            let at = (0.05 + 0.85 * rng.f64()) * load;
            let victim = rng.usize(0..self.dispatchers);
            let down = Duration::from_millis(rng.u64(500..3000));
            faults.push((
                Duration::from_secs_f64(at),
                Fault::KillDispatcher { victim, down },
            ));
        }
        faults.sort_by_key(|f| f.0);
        self.faults = faults;
    }

    /// How many faults of `kind` the schedule holds.
    #[cfg(test)]
    pub fn planned(&self, kind: &str) -> usize {
        self.faults.iter().filter(|(_, f)| f.kind() == kind).count()
    }

    /// Rows the producer brings from BigQuery; the rest come from the applications.
    pub fn bigquery_rows(&self) -> usize {
        (self.rows as f64 * self.bigquery_share) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_replays_the_same_schedule_and_every_fault_kind_is_in_the_short_one() {
        let mut a = Plan::new(Mode::Short, 42);
        let mut b = Plan::new(Mode::Short, 42);
        a.schedule();
        b.schedule();
        assert_eq!(a.faults, b.faults);
        for kind in [
            "dispatcher_kill",
            "producer_kill",
            "pubsub_cut",
            "pubsub_stall",
            "postgres_restart",
            "long_transaction",
            "pause_resume",
            "dead_letter_replay",
        ] {
            assert!(a.planned(kind) >= 1, "{kind} planned");
        }
        assert!(a.faults.iter().all(|(at, _)| *at < a.load));
    }

    #[test]
    fn the_long_mode_meets_the_issue_minimums() {
        let mut p = Plan::new(Mode::Long, 7);
        p.schedule();
        assert!(p.rows >= 1_000_000);
        assert!(p.planned("dispatcher_kill") >= 20);
        assert!(p.planned("pubsub_cut") >= 2 && p.planned("pubsub_stall") >= 2);
        assert!(p.planned("postgres_restart") >= 1);
    }
}
