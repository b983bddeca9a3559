//! One execution of the batch job: pick this task's streams, run each, report.
//!
//! Cloud Run Jobs run `CLOUD_RUN_TASK_COUNT` tasks in parallel; task `CLOUD_RUN_TASK_INDEX` takes
//! the streams at positions `i` (sorted by name) where `i % count == index`. Streams of a task run
//! one after the other; a failed stream does not stop the others, but makes the exit code 1.

use std::time::Duration;

use outbox_runtime::shutdown::Shutdown;
use sqlx::PgPool;

use crate::bigquery::{Api, BigQuery};
use crate::config::{Stream, StreamsConfig};
use crate::errors::{ConfigError, Error};
use crate::report::{JobReport, StreamReport};
use crate::run::run_stream;

/// What to do when another execution is running the same stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum OnOverlap {
    /// Exit this stream's run at once (success, outcome "skipped"); the running one does the work.
    #[default]
    Skip,
    /// Wait for the other execution to finish, then read what is new after it.
    Wait,
}

/// How the job runs (built from the command line; tests build it directly).
#[derive(Debug, Clone)]
pub struct Settings {
    /// BigQuery rows per page, and so per PostgreSQL transaction.
    pub page_size: u32,
    /// What to do when the stream is already running elsewhere.
    pub on_overlap: OnOverlap,
    /// Read and map, but write nothing.
    pub dry_run: bool,
    /// Sample messages a dry run reports per stream.
    pub dry_run_sample: usize,
    /// NOTIFY channel the dispatcher listens on.
    pub notify_channel: String,
    /// Attribute name the dispatcher adds with the dedupe key (counted in the limits).
    pub dedupe_attribute: String,
    /// Project of short topic names (empty: topics must be full names).
    pub pubsub_project: String,
    /// Who runs (recorded in `producer_run.executor`).
    pub executor: String,
    /// How often long runs log progress.
    pub progress_interval: Duration,
    /// This task's index among `task_count`.
    pub task_index: usize,
    /// Parallel tasks sharing the streams.
    pub task_count: usize,
    /// Only these streams (empty: all).
    pub only_streams: Vec<String>,
    /// Test hook: fail a stream's run right after this many committed chunks, as a crash would.
    #[doc(hidden)]
    pub fail_after_chunks: Option<usize>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            page_size: 1000,
            on_overlap: OnOverlap::Skip,
            dry_run: false,
            dry_run_sample: 10,
            notify_channel: outbox_shared::store::notify::DEFAULT_CHANNEL.to_owned(),
            dedupe_attribute: outbox_shared::DEFAULT_DEDUPE_ATTRIBUTE.to_owned(),
            pubsub_project: String::new(),
            executor: executor_id(),
            progress_interval: Duration::from_secs(10),
            task_index: 0,
            task_count: 1,
            only_streams: Vec::new(),
            fail_after_chunks: None,
        }
    }
}

/// The streams this task runs: `--stream` filter first, then the task split.
pub fn select_streams<'c>(
    config: &'c StreamsConfig,
    settings: &Settings,
) -> Result<Vec<&'c Stream>, ConfigError> {
    let unknown: Vec<String> = settings
        .only_streams
        .iter()
        .filter(|n| !config.streams.iter().any(|s| &s.name == *n))
        .map(|n| format!("--stream {n}: no stream has this name"))
        .collect();
    if !unknown.is_empty() {
        return Err(ConfigError::new("--stream", unknown));
    }
    if settings.task_count == 0 || settings.task_index >= settings.task_count {
        let problem = format!(
            "task index {} is not below task count {}",
            settings.task_index, settings.task_count
        );
        return Err(ConfigError::new(
            "CLOUD_RUN_TASK_INDEX/CLOUD_RUN_TASK_COUNT",
            vec![problem],
        ));
    }
    Ok(config
        .streams
        .iter()
        .filter(|s| settings.only_streams.is_empty() || settings.only_streams.contains(&s.name))
        .enumerate()
        .filter(|(i, _)| i % settings.task_count == settings.task_index)
        .map(|(_, s)| s)
        .collect())
}

/// Runs this task's streams in turn and reports each. Never fails as a whole: each stream's
/// error is logged once here and kept in the report.
pub async fn run_job<A: Api>(
    pool: &PgPool,
    bq: &BigQuery<A>,
    streams: &[&Stream],
    settings: &Settings,
    shutdown: &Shutdown,
) -> JobReport {
    let mut report = JobReport::default();
    if streams.is_empty() {
        tracing::info!(
            task = settings.task_index,
            tasks = settings.task_count,
            "no streams for this task"
        );
    }
    for stream in streams {
        let result = if shutdown.is_requested() {
            Err(Error::Interrupted {
                stream: stream.name.clone(),
                chunks: 0,
            })
        } else {
            run_stream(pool, bq, stream, settings, shutdown).await
        };
        match &result {
            Ok(summary) => summary.log(),
            Err(e) => tracing::error!(stream = %stream.name, error = %e, "stream run failed"),
        }
        report.streams.push(StreamReport {
            stream: stream.name.clone(),
            result,
        });
    }
    report
}

/// `CLOUD_RUN_EXECUTION/CLOUD_RUN_TASK_INDEX` on Cloud Run, else the host name.
pub fn executor_id() -> String {
    match std::env::var("CLOUD_RUN_EXECUTION") {
        Ok(execution) => {
            format!(
                "{execution}/{}",
                std::env::var("CLOUD_RUN_TASK_INDEX").unwrap_or_else(|_| "0".into())
            )
        }
        Err(_) => std::env::var("HOSTNAME").unwrap_or_else(|_| "local".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{LoadOptions, StreamsConfig};

    fn config(names: &[&str]) -> StreamsConfig {
        let text: String = names
            .iter()
            .map(|n| {
                format!(
                    "[[stream]]\nname = \"{n}\"\nquery = \"SELECT @watermark_ts, @watermark_key\"\n\
                     dedupe_key = [\"id\"]\ntopic = \"projects/p/topics/t\"\n\
                     cursor = {{ timestamp_column = \"ts\", key_column = \"id\", key_type = \"INT64\" }}\n\
                     payload = {{ columns = [\"id\"] }}\n"
                )
            })
            .collect();
        StreamsConfig::parse(&text, "test", &LoadOptions::default()).expect("valid config")
    }

    fn names(streams: &[&Stream]) -> Vec<String> {
        streams.iter().map(|s| s.name.clone()).collect()
    }

    #[test]
    fn tasks_split_streams_by_index_over_the_sorted_names() {
        let c = config(&["e", "a", "d", "b", "c"]);
        let task = |index, count| Settings {
            task_index: index,
            task_count: count,
            ..Settings::default()
        };
        assert_eq!(
            names(&select_streams(&c, &task(0, 1)).expect("ok")),
            ["a", "b", "c", "d", "e"]
        );
        assert_eq!(
            names(&select_streams(&c, &task(0, 2)).expect("ok")),
            ["a", "c", "e"]
        );
        assert_eq!(
            names(&select_streams(&c, &task(1, 2)).expect("ok")),
            ["b", "d"]
        );
        assert!(
            select_streams(&c, &task(5, 6)).expect("ok").is_empty(),
            "more tasks than streams"
        );
        assert!(select_streams(&c, &task(2, 2)).is_err());
    }

    #[test]
    fn the_stream_filter_applies_before_the_split_and_rejects_unknown_names() {
        let c = config(&["a", "b", "c"]);
        let s = Settings {
            only_streams: vec!["c".into(), "a".into()],
            ..Settings::default()
        };
        assert_eq!(names(&select_streams(&c, &s).expect("ok")), ["a", "c"]);
        let s = Settings {
            only_streams: vec!["zzz".into()],
            ..Settings::default()
        };
        let err = select_streams(&c, &s).expect_err("unknown stream");
        assert!(err.to_string().contains("zzz"), "{err}");
    }
}
