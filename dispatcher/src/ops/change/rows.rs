//! The two tables an operator changes rows of, as the engine reads them: the outbox's
//! unpublished rows (outbox ids) and the dead letters (dead-letter ids). Each reads its
//! selection a page at a time from a cursor, says which ids it holds at all, and how it is named
//! to a person; the filters the commands take (shared by `list` and the changes) are here too.

use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};
use outbox_runtime::operator::{OpsError, parse_instant};
use outbox_shared::store::dead_letter::{self, DeadLetter};
use outbox_shared::store::pending::{self, Pending, Selection};
use serde::Serialize;
use sqlx::PgConnection;

use crate::ops::{ProjectArg, Unknown, known_topic};

/// Which table a report's ids name: outbox ids and dead-letter ids overlap, so every report
/// says which it lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Ids {
    Outbox,
    DeadLetter,
}

/// A table the engine changes rows of.
pub trait Rows: Send + Sync + 'static {
    /// A row as a page holds it.
    type Row: Send + Sync;
    /// A selection of its rows (the audit's selector is its JSON, without the ids).
    type Filter: Serialize + Clone + std::fmt::Debug + Send + Sync;
    /// Which ids.
    const IDS: Ids;
    /// What one row is to a person.
    const NOUN: &'static str;
    /// What many are.
    const PLURAL: &'static str;
    /// What its ids are called.
    const ID: &'static str;
    /// The filter flags, for "needs ids or a filter".
    const FILTER_FLAGS: &'static str;
    /// The command that lists the ids.
    const LIST: &'static str;
    /// Why an id may be missing, and where to look.
    const MISSING: &'static str;

    fn id(row: &Self::Row) -> i64;
    /// (topic, ordering key) of a keyed row.
    fn key(row: &Self::Row) -> Option<(String, String)>;
    /// The filter's topic, as given.
    fn topic(filter: &Self::Filter) -> Option<&str>;
    /// The filter with its topic resolved to a full name.
    fn with_topic(filter: Self::Filter, topic: String) -> Self::Filter;
    /// Whether the filter (ids aside) selects everything.
    fn narrows_nothing(filter: &Self::Filter) -> bool;

    /// The next page of the selection after `cursor` (the previous page's last id), at most
    /// `size` rows, in the table's id order.
    fn page(
        conn: &mut PgConnection,
        filter: &Self::Filter,
        size: i64,
        cursor: Option<i64>,
    ) -> impl Future<Output = Result<Vec<Self::Row>, OpsError>> + Send;

    /// Which of `ids` the table holds at all, whatever the filter.
    fn holding(
        conn: &mut PgConnection,
        ids: &[i64],
    ) -> impl Future<Output = Result<Vec<i64>, OpsError>> + Send;
}

/// The outbox's unpublished rows.
#[derive(Debug, Clone, Copy)]
pub struct Outbox;

impl Rows for Outbox {
    type Row = Pending;
    type Filter = Selection;
    const IDS: Ids = Ids::Outbox;
    const NOUN: &'static str = "unpublished message";
    const PLURAL: &'static str = "unpublished message(s), by outbox id";
    const ID: &'static str = "outbox";
    const FILTER_FLAGS: &'static str = "--topic, --ordering-key, --dedupe-prefix, \
                                        --created-before/--created-after, --error-contains";
    const LIST: &'static str = "dispatcher pending list shows the ids";
    const MISSING: &'static str = "published already, cancelled, or never written: dispatcher \
                                   pending list shows the ids";

    fn id(row: &Pending) -> i64 {
        row.id
    }

    fn key(row: &Pending) -> Option<(String, String)> {
        row.ordering_key.clone().map(|k| (row.topic.clone(), k))
    }

    fn topic(filter: &Selection) -> Option<&str> {
        filter.topic.as_deref()
    }

    fn with_topic(filter: Selection, topic: String) -> Selection {
        Selection {
            topic: Some(topic),
            ..filter
        }
    }

    fn narrows_nothing(filter: &Selection) -> bool {
        Selection {
            ids: None,
            ..filter.clone()
        }
        .is_empty()
    }

    async fn page(
        conn: &mut PgConnection,
        filter: &Selection,
        size: i64,
        cursor: Option<i64>,
    ) -> Result<Vec<Pending>, OpsError> {
        Ok(pending::select(conn, filter, size, cursor).await?)
    }

    async fn holding(conn: &mut PgConnection, ids: &[i64]) -> Result<Vec<i64>, OpsError> {
        let all = Selection {
            ids: Some(ids.to_vec()),
            ..Selection::default()
        };
        let limit = i64::try_from(ids.len()).unwrap_or(i64::MAX);
        Ok(pending::select(conn, &all, limit, None)
            .await?
            .iter()
            .map(|r| r.id)
            .collect())
    }
}

/// The dead letters.
#[derive(Debug, Clone, Copy)]
pub struct DeadLetters;

impl Rows for DeadLetters {
    type Row = DeadLetter;
    type Filter = dead_letter::Filter;
    const IDS: Ids = Ids::DeadLetter;
    const NOUN: &'static str = "dead letter";
    const PLURAL: &'static str = "dead letter(s)";
    const ID: &'static str = "dead letter";
    const FILTER_FLAGS: &'static str = "--topic, --kind, --ordering-key, --dedupe-prefix, \
                                        --failed-before/--failed-after, --error-contains, \
                                        discard's --older-than";
    const LIST: &'static str = "dispatcher dead-letters list shows the ids";
    const MISSING: &'static str = "replayed or discarded already, or a typo: dispatcher \
                                   dead-letters list shows the ids (an id printed by `pending \
                                   cancel` is the dead letter's)";

    fn id(row: &DeadLetter) -> i64 {
        row.id
    }

    fn key(row: &DeadLetter) -> Option<(String, String)> {
        row.ordering_key.clone().map(|k| (row.topic.clone(), k))
    }

    fn topic(filter: &dead_letter::Filter) -> Option<&str> {
        filter.topic.as_deref()
    }

    fn with_topic(filter: dead_letter::Filter, topic: String) -> dead_letter::Filter {
        dead_letter::Filter {
            topic: Some(topic),
            ..filter
        }
    }

    fn narrows_nothing(filter: &dead_letter::Filter) -> bool {
        dead_letter::Filter {
            ids: None,
            ..filter.clone()
        }
        .is_empty()
    }

    async fn page(
        conn: &mut PgConnection,
        filter: &dead_letter::Filter,
        size: i64,
        cursor: Option<i64>,
    ) -> Result<Vec<DeadLetter>, OpsError> {
        Ok(dead_letter::select(conn, filter, size, cursor).await?)
    }

    async fn holding(conn: &mut PgConnection, ids: &[i64]) -> Result<Vec<i64>, OpsError> {
        let all = dead_letter::Filter {
            ids: Some(ids.to_vec()),
            ..dead_letter::Filter::default()
        };
        let limit = i64::try_from(ids.len()).unwrap_or(i64::MAX);
        Ok(dead_letter::select(conn, &all, limit, None)
            .await?
            .iter()
            .map(|d| d.id)
            .collect())
    }
}

/// The full name of a filter's `topic` as given: a malformed name or one nothing in the database
/// names is refused (exit 2) with the known ones near it.
pub async fn resolve<R: Rows>(
    conn: &mut PgConnection,
    project: &ProjectArg,
    filter: R::Filter,
) -> Result<R::Filter, OpsError> {
    match R::topic(&filter).map(str::to_owned) {
        Some(given) => {
            let full = known_topic(conn, project, &given, Unknown::Refuse("")).await?;
            Ok(R::with_topic(filter, full))
        }
        None => Ok(filter),
    }
}

/// The outbox filter's fields as a form names them (the console), with their flags.
pub const OUTBOX_FIELDS: &[(&str, &str)] = &[
    ("topic", "--topic"),
    ("ordering_key", "--ordering-key"),
    ("dedupe_prefix", "--dedupe-prefix"),
    ("created_after", "--created-after"),
    ("created_before", "--created-before"),
    ("error_contains", "--error-contains"),
];

/// The dead-letter filter's fields as a form names them (the console), with their flags.
pub const DEAD_LETTER_FIELDS: &[(&str, &str)] = &[
    ("topic", "--topic"),
    ("kind", "--kind"),
    ("ordering_key", "--ordering-key"),
    ("dedupe_prefix", "--dedupe-prefix"),
    ("failed_after", "--failed-after"),
    ("failed_before", "--failed-before"),
    ("error_contains", "--error-contains"),
];

/// Which unpublished messages (every flag narrows the selection).
#[derive(Debug, Clone, clap::Args)]
pub struct OutboxFilter {
    /// Full topic name (or a short one with --pubsub-project).
    #[arg(long)]
    pub topic: Option<String>,
    #[command(flatten)]
    pub project: ProjectArg,
    /// This ordering key.
    #[arg(long)]
    pub ordering_key: Option<String>,
    /// Dedupe keys starting with this.
    #[arg(long)]
    pub dedupe_prefix: Option<String>,
    /// Enqueued before this (RFC 3339, or a duration ago such as 2h).
    #[arg(long)]
    pub created_before: Option<String>,
    /// Enqueued after this (RFC 3339, or a duration ago such as 2h).
    #[arg(long)]
    pub created_after: Option<String>,
    /// Text the last error contains (case-insensitive).
    #[arg(long)]
    pub error_contains: Option<String>,
}

impl OutboxFilter {
    /// The selection: `ids` (when any) and the flags; `waiting` keeps the rows waiting for a
    /// retry. The topic stays as given: [`resolve`] checks it against the database.
    pub fn selection(
        &self,
        ids: &[i64],
        now: DateTime<Utc>,
        waiting: bool,
    ) -> Result<Selection, OpsError> {
        let instant = |flag, v: &Option<String>| {
            v.as_deref()
                .map(|s| parse_instant(flag, s, now))
                .transpose()
        };
        let s = Selection {
            ids: (!ids.is_empty()).then(|| ids.to_vec()),
            topic: self.topic.clone(),
            ordering_key: self.ordering_key.clone(),
            dedupe_prefix: self.dedupe_prefix.clone().filter(|p| !p.is_empty()),
            created_before: instant("--created-before", &self.created_before)?,
            created_after: instant("--created-after", &self.created_after)?,
            error_contains: self.error_contains.clone().filter(|p| !p.is_empty()),
            waiting_at: waiting.then_some(now),
        };
        if let (Some(b), Some(a)) = (s.created_before, s.created_after)
            && b <= a
        {
            return Err(OpsError::Usage(format!(
                "--created-before ({b}) is not after --created-after ({a}): the filter can match nothing"
            )));
        }
        Ok(s)
    }
}

/// Which dead letters (every flag narrows the selection).
#[derive(Debug, Clone, clap::Args)]
pub struct DeadLetterFilter {
    /// Full topic name (or a short one with --pubsub-project).
    #[arg(long)]
    pub topic: Option<String>,
    #[command(flatten)]
    pub project: ProjectArg,
    /// Error kind: permanent, exhausted, rejected or cancelled.
    #[arg(long, value_parser = ["permanent", "exhausted", "rejected", "cancelled"])]
    pub kind: Option<String>,
    /// This ordering key.
    #[arg(long)]
    pub ordering_key: Option<String>,
    /// Dedupe keys starting with this.
    #[arg(long)]
    pub dedupe_prefix: Option<String>,
    /// Failed before this (RFC 3339, or a duration ago such as 2h).
    #[arg(long)]
    pub failed_before: Option<String>,
    /// Failed after this (RFC 3339, or a duration ago such as 2h).
    #[arg(long)]
    pub failed_after: Option<String>,
    /// Text the error contains (case-insensitive).
    #[arg(long)]
    pub error_contains: Option<String>,
}

impl DeadLetterFilter {
    /// The filter: `ids` (when any), the flags, and `older_than` (discard) as a failed-before.
    /// The topic stays as given: [`resolve`] checks it against the database.
    pub fn filter(
        &self,
        ids: &[i64],
        now: DateTime<Utc>,
        older_than: Option<Duration>,
    ) -> Result<dead_letter::Filter, OpsError> {
        let instant = |flag, v: &Option<String>| {
            v.as_deref()
                .map(|s| parse_instant(flag, s, now))
                .transpose()
        };
        let mut failed_before = instant("--failed-before", &self.failed_before)?;
        if let Some(age) = older_than {
            let cut = chrono::Duration::from_std(age)
                .ok()
                .and_then(|d| now.checked_sub_signed(d))
                .ok_or_else(|| OpsError::Usage(format!("--older-than {age:?} is too long")))?;
            failed_before = Some(failed_before.map_or(cut, |b| b.min(cut)));
        }
        let filter = dead_letter::Filter {
            ids: (!ids.is_empty()).then(|| ids.to_vec()),
            topic: self.topic.clone(),
            error_kind: self.kind.clone(),
            ordering_key: self.ordering_key.clone(),
            dedupe_prefix: self.dedupe_prefix.clone().filter(|p| !p.is_empty()),
            failed_before,
            failed_after: instant("--failed-after", &self.failed_after)?,
            error_contains: self.error_contains.clone().filter(|p| !p.is_empty()),
        };
        if let (Some(b), Some(a)) = (filter.failed_before, filter.failed_after)
            && b <= a
        {
            return Err(OpsError::Usage(format!(
                "--failed-before ({b}) is not after --failed-after ({a}): the filter can match nothing"
            )));
        }
        Ok(filter)
    }
}
