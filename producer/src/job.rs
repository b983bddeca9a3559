//! One execution of the batch job: pick this task's streams, run each, report.
//!
//! Cloud Run Jobs run `CLOUD_RUN_TASK_COUNT` tasks in parallel; task `CLOUD_RUN_TASK_INDEX` takes
//! the streams at positions `i` (sorted by name) where `i % count == index`. Streams of a task run
//! one after the other; a failed stream does not stop the others, but makes the exit code 1.
//! The job chooses the mode of each stream's run: [`run_stream`] or, with `--dry-run`,
//! [`dry_run_stream`].

use outbox_runtime::shutdown::Shutdown;
use sqlx::PgPool;

use crate::bigquery::{Api, BigQuery};
use crate::config::{Stream, StreamsConfig};
use crate::dry_run::dry_run_stream;
use crate::errors::{ConfigError, ErrorKind, StreamError};
use crate::report::{JobReport, StreamReport, StreamSummary};
use crate::run::run_stream;
use crate::settings::Settings;

/// The streams this task runs: `--stream` filter first, then the task split.
pub fn select_streams<'c>(
    config: &'c StreamsConfig,
    settings: &Settings,
) -> Result<Vec<&'c Stream>, ConfigError> {
    let names: Vec<&str> = config.streams.iter().map(|s| s.name.as_str()).collect();
    let unknown: Vec<String> = settings
        .only_streams
        .iter()
        .filter(|n| !names.contains(&n.as_str()))
        .map(|n| {
            let close = outbox_runtime::operator::near(n, names.iter().copied());
            format!(
                "--stream {n:?}: the streams file has no stream of this name ({}its streams: {})",
                if close.is_empty() {
                    String::new()
                } else {
                    format!("did you mean {}? ", close.join(" or "))
                },
                names.join(", ")
            )
        })
        .collect();
    if !unknown.is_empty() {
        return Err(ConfigError::flag("--stream", unknown));
    }
    if settings.task_count == 0 || settings.task_index >= settings.task_count {
        let problem = format!(
            "task index {} is not below task count {}",
            settings.task_index, settings.task_count
        );
        return Err(ConfigError::flag(
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
/// error is logged once here, at ERROR (an operator must act: the stream is not advancing), and
/// kept in the report.
#[tracing::instrument(
    name = "producer run",
    skip_all,
    fields(task = settings.task_index, tasks = settings.task_count, streams = streams.len())
)]
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
            "No streams for this task."
        );
    }
    for stream in streams {
        let result = run_one(pool, bq, stream, settings, shutdown).await;
        match &result {
            Ok(summary) => summary.log(),
            Err(e) => {
                tracing::error!(stream = %stream.name, error = %e, "Stream run failed; fix the cause and rerun (the next run resumes from the watermark).")
            }
        }
        report.streams.push(StreamReport {
            stream: stream.name.clone(),
            result,
        });
    }
    report
}

/// One stream in the mode the settings ask for.
async fn run_one<A: Api>(
    pool: &PgPool,
    bq: &BigQuery<A>,
    stream: &Stream,
    settings: &Settings,
    shutdown: &Shutdown,
) -> Result<StreamSummary, StreamError> {
    if shutdown.is_requested() {
        Err(StreamError::new(
            &stream.name,
            ErrorKind::Interrupted { chunks: 0 },
        ))
    } else if settings.dry_run {
        dry_run_stream(pool, bq, stream, settings).await
    } else {
        run_stream(pool, bq, stream, settings, shutdown).await
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
                     dedupe_key = [\"id\"]\ntopic = \"projects/test-project/topics/orders\"\n\
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
