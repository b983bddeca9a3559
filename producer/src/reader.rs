//! The ordered row reader both modes iterate: from a stored watermark to mapped rows, in order.
//!
//! [`stored_watermark`] reads where the stream stands (one rule for both modes);
//! [`StreamQuery::new`] computes the lower bound (the stored watermark, or `lookback` before it)
//! and the query; [`StreamQuery::open`] runs it and resolves the mapping against the result's
//! schema (every configured column is checked before anything is written); [`OrderedRows`] then
//! yields each page's rows mapped, and fails the run unless the rows arrive strictly increasing
//! in `(timestamp, key)` and after the lower bound (a query without the right ORDER BY / WHERE
//! could lose rows).

use outbox_shared::store::watermark::{self, Cursor};
use sqlx::PgConnection;

use crate::bigquery::{Api, BigQuery, Pages, QuerySpec};
use crate::config::Stream;
use crate::cursor::Position;
use crate::errors::{ErrorKind, InStream, StreamError};
use crate::mapping::{MappedRow, Mapper};
use crate::settings::Settings;

/// The stream's stored watermark, and the position it stands for (None before its first run).
///
/// One rule for a run and a dry run: a watermark the stream's `cursor.key_type` cannot read (a
/// changed config) fails the stream. Reading from the start instead would re-read everything, and
/// a run would offer every row again.
pub(crate) async fn stored_watermark(
    conn: &mut PgConnection,
    stream: &Stream,
) -> Result<Option<(Cursor, Position)>, StreamError> {
    let name = stream.name.as_str();
    let Some(cursor) = watermark::get(conn, name).await.in_stream(name)? else {
        return Ok(None);
    };
    match Position::from_cursor(&cursor, stream.cursor.key_type) {
        Some(position) => Ok(Some((cursor, position))),
        None => {
            let kind = ErrorKind::StoredWatermark {
                key: cursor.key,
                key_type: format!("{:?}", stream.cursor.key_type),
            };
            Err(StreamError::new(name, kind))
        }
    }
}

/// A stream's query from a stored watermark, not yet run.
#[derive(Debug)]
pub(crate) struct StreamQuery<'s> {
    stream: &'s Stream,
    lower: Position,
    spec: QuerySpec,
}

impl<'s> StreamQuery<'s> {
    /// The query of `stream` after `stored` (or from the start), read as `settings` say.
    pub(crate) fn new(stream: &'s Stream, stored: Option<&Position>, settings: &Settings) -> Self {
        let lower = Position::lower_bound(stored, stream.lookback, stream.cursor.key_type);
        let spec = QuerySpec {
            query: stream.query.clone(),
            params: lower.parameters(),
            location: stream.location.clone(),
            maximum_bytes_billed: stream.maximum_bytes_billed,
            page_size: settings.page_size.max(1),
            page_bytes: settings.page_bytes,
            parallel_reads: settings.parallel_reads,
        };
        Self {
            stream,
            lower,
            spec,
        }
    }

    /// Where the rows start (exclusive).
    pub(crate) fn lower(&self) -> &Position {
        &self.lower
    }

    /// BigQuery's estimate of the bytes the query processes (a free dry-run job).
    pub(crate) async fn estimate_bytes<A: Api>(
        &self,
        bq: &BigQuery<A>,
    ) -> Result<Option<i64>, StreamError> {
        bq.estimate_bytes(&self.spec)
            .await
            .map_err(|e| StreamError::pages(&self.stream.name, e))
    }

    /// Runs the query and checks the mapping against its result.
    pub(crate) async fn open<'b, A: Api>(
        self,
        bq: &'b BigQuery<A>,
        settings: &Settings,
    ) -> Result<OrderedRows<'b, 's, A>, StreamError> {
        let name = self.stream.name.as_str();
        let pages = bq
            .open(&self.spec)
            .await
            .map_err(|e| StreamError::pages(name, e))?;
        let mapper = Mapper::new(
            self.stream,
            pages.schema(),
            &settings.dedupe_attribute,
            &settings.pubsub_project,
        )?;
        Ok(OrderedRows {
            stream: self.stream,
            pages,
            mapper,
            previous: self.lower,
            rows: 0,
        })
    }
}

/// A running query's rows, mapped and checked for order, page by page.
#[derive(Debug)]
pub(crate) struct OrderedRows<'b, 's, A> {
    stream: &'s Stream,
    pages: Pages<'b, A>,
    mapper: Mapper<'s>,
    /// The last row's position (the lower bound before the first row).
    previous: Position,
    rows: u64,
}

impl<A: Api> OrderedRows<'_, '_, A> {
    /// BigQuery's job id (for logs).
    pub(crate) fn job_id(&self) -> &str {
        self.pages.job_id()
    }

    /// Bytes the query processed, once BigQuery reported it.
    pub(crate) fn bytes_processed(&self) -> Option<i64> {
        self.pages.bytes_processed()
    }

    /// The last row's position, or the lower bound before any row.
    pub(crate) fn last(&self) -> &Position {
        &self.previous
    }

    /// Rows read so far.
    pub(crate) fn rows(&self) -> u64 {
        self.rows
    }

    /// The next page's rows mapped (possibly empty), or None after the last page.
    pub(crate) async fn next_page(&mut self) -> Result<Option<Vec<MappedRow>>, StreamError> {
        let name = self.stream.name.as_str();
        let Some(rows) = self
            .pages
            .next_page()
            .await
            .map_err(|e| StreamError::pages(name, e))?
        else {
            return Ok(None);
        };
        let mut mapped = Vec::with_capacity(rows.len());
        for row in &rows {
            let m = self.mapper.map_row(row)?;
            if m.position <= self.previous {
                return Err(self.order_error(&m.position));
            }
            self.previous = m.position.clone();
            self.rows += 1;
            mapped.push(m);
        }
        Ok(Some(mapped))
    }

    fn order_error(&self, row: &Position) -> StreamError {
        let previous = &self.previous;
        let detail = if self.rows == 0 {
            format!("a row at {row} is not after the lower bound {previous} the query was given")
        } else if row == previous {
            format!("two rows share the cursor {row}")
        } else {
            format!("a row at {row} came after {previous}: rows are not in cursor order")
        };
        StreamError::new(&self.stream.name, ErrorKind::CursorOrder(detail))
    }
}
