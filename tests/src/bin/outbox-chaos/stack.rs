//! The run's own stack: a scratch database on the private PostgreSQL cluster (which this module
//! restarts) and a consumer database beside it, three topics on the private Pub/Sub emulator (the
//! application topic with a second subscription, for the inbox consumer), a fault-injecting TCP proxy in front
//! of it for the dispatchers, a BigQuery table on bqemulator, and the binaries as children.
//!
//! `scripts/chaos` starts the services (scripts/services with its own state dir and ports) and
//! stops them; everything this module creates is removed when the [`Stack`] is stopped or dropped
//! (databases, topics, subscriptions, the dataset), and children are killed on drop.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::str::FromStr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use gcp_bigquery_client::model::field_type::FieldType;
use gcp_bigquery_client::model::table_field_schema::TableFieldSchema;
use harness::bigquery::TestTable;
use harness::db::TestDb;
use harness::process::{Process, Spawn};
use harness::proxy::TcpProxy;
use harness::pubsub::{TestSubscription, TestTopic};
use sqlx::postgres::PgConnectOptions;
use tokio::process::Command;

/// How to restart the private cluster.
#[derive(Debug, Clone)]
pub struct PgControl {
    pub bindir: PathBuf,
    pub data: PathBuf,
    pub log: PathBuf,
    pub os_user: String,
}

/// The services of one run.
#[derive(Debug)]
pub struct Stack {
    pub db: TestDb,
    pub pg_port: u16,
    pg: PgControl,
    /// Keyed and unkeyed application rows; unpublishable ones carry an oversize attribute.
    pub app: TestTopic,
    /// The application topic's second subscription, read through the inbox (`inbox` module).
    pub inbox_subscription: TestSubscription,
    /// The inbox consumer's database (on the same cluster, so it restarts with it).
    pub consumer_db: TestDb,
    /// Validates `{"amount": <int>}`: unpublishable rows carry other JSON.
    pub schema: TestTopic,
    /// The producer's stream.
    pub bigquery_topic: TestTopic,
    pub table: TestTable,
    /// The dispatchers reach Pub/Sub only through this.
    pub proxy: TcpProxy,
    bin_dir: PathBuf,
    pub work_dir: PathBuf,
}

impl Stack {
    pub async fn start(
        admin_url: &str,
        pg: PgControl,
        bin_dir: PathBuf,
        work_dir: PathBuf,
    ) -> Result<Self> {
        for bin in ["dispatcher", "producer"] {
            if !bin_dir.join(bin).exists() {
                bail!(
                    "{} is missing: build the binaries first (cargo build --workspace --bins) or pass --bin-dir",
                    bin_dir.join(bin).display()
                );
            }
        }
        if !pg.bindir.join("pg_ctl").exists() {
            bail!("no pg_ctl in {}", pg.bindir.display());
        }
        let pg_port = PgConnectOptions::from_str(admin_url)
            .context("parsing DATABASE_URL")?
            .get_port();
        let db = TestDb::create(admin_url, "outbox_chaos")
            .await
            .context("creating the chaos database on the private cluster")?;
        let emulator = harness::env::pubsub_emulator_host();
        let proxy = TcpProxy::start(&emulator).await;
        // The official client hangs rather than fails when the emulator is not there: bound it.
        let topics = tokio::time::timeout(Duration::from_secs(60), async {
            (
                TestTopic::new(true).await,
                TestTopic::with_schema(true).await,
                TestTopic::new(true).await,
            )
        })
        .await
        .map_err(|_| anyhow!("the Pub/Sub emulator at {emulator} did not answer within 60 s"))?;
        // Ordered like the first; a 10 s ack deadline brings an aborted consumer's messages back.
        let inbox_subscription = topics.0.add_subscription(true, 10).await;
        let consumer_db = TestDb::create(admin_url, "outbox_chaos_consumer")
            .await
            .context("creating the inbox consumer's database on the private cluster")?;
        let table = tokio::time::timeout(
            Duration::from_secs(60),
            TestTable::create(vec![
                TableFieldSchema::integer("id"),
                TableFieldSchema::new("updated_at", FieldType::Timestamp),
                TableFieldSchema::string("customer"),
                TableFieldSchema::string("note"),
                TableFieldSchema::integer("amount"),
            ]),
        )
        .await
        .map_err(|_| anyhow!("bqemulator did not answer within 60 s"))?;
        Ok(Self {
            db,
            pg_port,
            pg,
            app: topics.0,
            inbox_subscription,
            consumer_db,
            schema: topics.1,
            bigquery_topic: topics.2,
            table,
            proxy,
            bin_dir,
            work_dir,
        })
    }

    /// Removes the database (after closing the pool), the topics and the dataset.
    pub async fn stop(self) {
        self.db.pool.close().await;
        self.consumer_db.pool.close().await;
        drop(self);
    }

    /// Starts `bin` with `args`, its output to `<work_dir>/<tag>.log`.
    pub fn spawn(&self, bin: &str, args: &[String], tag: &str) -> Result<Process> {
        Ok(Spawn::program(self.bin_dir.join(bin))
            .args(args)
            .env("DATABASE_URL", self.db.url())
            // Pub/Sub only through the proxy (the verdict's subscriber goes direct).
            .env("PUBSUB_EMULATOR_HOST", self.proxy.addr())
            .env(
                "BIGQUERY_EMULATOR_HOST",
                harness::env::bigquery_emulator_host(),
            )
            .env("BIGQUERY_PROJECT_ID", harness::env::bigquery_project())
            .env("PUBSUB_PROJECT_ID", harness::env::pubsub_project())
            .env("OUTBOX_LOG", "warn")
            .log(self.work_dir.join(format!("{tag}.log")))
            .start()?)
    }

    /// Runs an operator command (`dispatcher <args>`) and returns its stdout; fails unless it
    /// exits 0 within 60 s.
    pub async fn operator(&self, args: &[&str]) -> Result<String> {
        let out = Spawn::program(self.bin_dir.join("dispatcher"))
            .args(args)
            .env("DATABASE_URL", self.db.url())
            .env("OUTBOX_ACTOR", "outbox-chaos")
            .env("OUTBOX_LOG", "warn")
            .output(Duration::from_secs(60))
            .await?;
        if !out.status.success() {
            bail!(
                "dispatcher {args:?} failed ({}): {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `pg_ctl restart -m fast`: every session is ended, the server comes back on its port.
    /// Returns how long the server was unavailable.
    pub async fn restart_postgres(&self) -> Result<Duration> {
        let started = Instant::now();
        let pg_ctl = self.pg.bindir.join("pg_ctl");
        let mut args: Vec<String> = vec![path(&pg_ctl)];
        args.extend(
            [
                "restart",
                "-D",
                &path(&self.pg.data),
                "-m",
                "fast",
                "-w",
                "-t",
                "60",
                "-l",
                &path(&self.pg.log),
            ]
            .map(str::to_owned),
        );
        let mut cmd = if running_as_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", &self.pg.os_user, "--"]).args(&args);
            c
        } else {
            let mut c = Command::new(&args[0]);
            c.args(&args[1..]);
            c
        };
        let out = tokio::time::timeout(
            Duration::from_secs(90),
            cmd.current_dir("/")
                .stdin(Stdio::null())
                .kill_on_drop(true)
                .output(),
        )
        .await
        .map_err(|_| anyhow!("pg_ctl restart did not finish within 90 s"))??;
        if !out.status.success() {
            bail!(
                "pg_ctl restart failed ({}): {} {}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(started.elapsed())
    }

    /// Transactions the process `pid` has open on PostgreSQL right now (a dispatcher holds one per
    /// batch in flight: claim, publish, settle, commit): its TCP connections to the server (ss)
    /// matched with pg_stat_activity by client port.
    pub async fn open_transactions_of(&self, pid: u32) -> Result<i64> {
        let out = Command::new("ss")
            .args(["-Htnp", "state", "established"])
            .arg(format!("( dport = :{} )", self.pg_port))
            .output()
            .await
            .context("running ss")?;
        let marker = format!("pid={pid},");
        let ports: Vec<i32> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.contains(&marker))
            .filter_map(|l| l.split_whitespace().nth(2))
            .filter_map(|local| local.rsplit(':').next())
            .filter_map(|p| p.parse().ok())
            .collect();
        if ports.is_empty() {
            return Ok(0);
        }
        let n: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
             WHERE client_port = ANY($1) AND xact_start IS NOT NULL AND pid <> pg_backend_pid()",
        )
        .bind(&ports)
        .fetch_one(&self.db.pool)
        .await?;
        Ok(n)
    }
}

fn path(p: &Path) -> String {
    p.to_string_lossy().into_owned()
}

fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .and_then(|l| l.split_whitespace().nth(1).map(|u| u == "0"))
        })
        .unwrap_or(false)
}
