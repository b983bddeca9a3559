//! `dispatcher dead-letters blocked`: the ordering keys dead letters hold back, a page at a time.
//! `status` counts them per topic and lists the first few; an incident (a keyed topic whose
//! Pub/Sub topic vanished) can block thousands, which this pages through by topic and key.

use chrono::{DateTime, Utc};
use outbox_runtime::operator::{Command, Common, Exit, OpsError, Output};
use outbox_runtime::table::{Table, printable};
use outbox_shared::store::status::{self, BlockedKey, BlockedQuery};
use sqlx::PgPool;

use super::{ProjectArg, Unknown, known_topic};
use crate::config::SkipDeadLetters;

/// `dead-letters blocked` options.
#[derive(Debug, Clone, clap::Args)]
pub struct BlockedArgs {
    #[command(flatten)]
    pub common: Common,
    /// Only this topic's keys (full name, or short with --pubsub-project).
    #[arg(long)]
    pub topic: Option<String>,
    #[command(flatten)]
    pub project: ProjectArg,
    /// At most this many keys (a page).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(1..=10_000))]
    pub limit: i64,
    /// The next page: keys after this one (the last of the previous page; its topic is
    /// --after-topic, else --topic).
    #[arg(long)]
    pub after_key: Option<String>,
    /// The next page: the topic of --after-key (full name), when listing every topic.
    #[arg(long, requires = "after_key")]
    pub after_topic: Option<String>,
    #[command(flatten)]
    pub skip_dead_letters: SkipDeadLetters,
}

/// A checked `dead-letters blocked`.
#[derive(Debug, Clone)]
pub struct Page {
    topic: Option<String>,
    project: ProjectArg,
    after_key: Option<String>,
    after_topic: Option<String>,
    limit: i64,
    skip_topics: Vec<String>,
}

impl Command for BlockedArgs {
    type Checked = Page;

    fn check(&self, _now: DateTime<Utc>) -> Result<Page, OpsError> {
        if self.after_key.is_some() && self.after_topic.is_none() && self.topic.is_none() {
            return Err(OpsError::Usage(
                "--after-key needs its topic: --after-topic T (the page before ended there), or \
                 --topic T to page through one topic"
                    .to_owned(),
            ));
        }
        Ok(Page {
            topic: self.topic.clone(),
            project: self.project.clone(),
            after_key: self.after_key.clone(),
            after_topic: self.after_topic.clone(),
            limit: self.limit,
            skip_topics: self.skip_dead_letters.topics.clone(),
        })
    }

    async fn run(p: Page, pool: &PgPool) -> Result<Output, OpsError> {
        // Read-only, inside a transaction (as behind a transaction-mode pooler it must be).
        let mut conn = pool.begin().await?;
        let topic = match &p.topic {
            Some(given) => {
                Some(known_topic(&mut conn, &p.project, given, Unknown::Refuse("")).await?)
            }
            None => None,
        };
        let after_topic = match &p.after_topic {
            Some(given) => Some(p.project.topic(given)?),
            None => topic.clone(),
        };
        let after = after_topic.as_deref().zip(p.after_key.as_deref());
        // One more than the page tells whether another page follows.
        let mut keys: Vec<BlockedKey> = status::blocked_keys(
            &mut conn,
            &BlockedQuery {
                skip_topics: &p.skip_topics,
                topic: topic.as_deref(),
                after,
                limit: p.limit + 1,
            },
        )
        .await?;
        let more = keys.len() as i64 > p.limit;
        keys.truncate(usize::try_from(p.limit).unwrap_or(usize::MAX));
        let mut t = Table::new(&["TOPIC", "ORDERING KEY", "DEAD LETTER", "WAITING"]);
        for k in &keys {
            t.row(vec![
                k.topic.clone(),
                printable(&k.ordering_key),
                k.dead_letter_id.to_string(),
                k.waiting.to_string(),
            ]);
        }
        let (text, exit) = if t.is_empty() {
            (
                "No ordering key is blocked by a dead letter.\n".to_owned(),
                Exit::NothingMatched,
            )
        } else {
            (t.render(), Exit::Ok)
        };
        let mut out = Output::new(text, &keys, exit)?;
        if let (true, Some(last)) = (more, keys.last()) {
            let next = match &topic {
                Some(topic) => format!("--topic {topic} --after-key {:?}", last.ordering_key),
                None => format!(
                    "--after-topic {} --after-key {:?}",
                    last.topic, last.ordering_key
                ),
            };
            out = out.note(format!(
                "more keys are blocked than this page of {} shows: the next page is {next}",
                p.limit
            ));
        }
        Ok(out)
    }
}
