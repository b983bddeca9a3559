//! All SQL of the project, one module per table. Nothing outside this module writes SQL.
//!
//! Functions take `&mut PgConnection` (a transaction derefs to one) so callers decide the
//! transaction boundaries: the producer enqueues and advances its watermark atomically; the
//! dispatcher claims and settles inside one transaction.

pub mod audit;
pub mod claim;
pub mod dead_letter;
pub mod held_topic;
pub mod lookback;
pub mod notify;
pub mod outbox;
pub mod pause;
pub mod pending;
pub mod replica;
pub mod run_ledger;
pub mod settle;
pub mod status;
pub mod topic;
pub mod watermark;

use std::sync::atomic::{AtomicBool, Ordering};

/// Whether statements are prepared under a name and cached per connection (the default), or sent
/// unnamed ([`use_unnamed_statements`]).
static NAMED_STATEMENTS: AtomicBool = AtomicBool::new(true);

/// Sends every statement of this module unnamed (prepared and run in one transaction, nothing
/// left on the server connection), for a connection pooler in transaction mode (PgBouncer, Cloud
/// SQL's managed pooling), where a named statement prepared on one server connection is missing,
/// or already taken by another client, on the next. Process-wide; set once at start-up, before
/// the first statement. Every statement must then run inside a transaction (sqlx prepares and
/// executes an unnamed statement in two exchanges, which a transaction pooler may route to two
/// server connections otherwise). The cost on a direct connection: docs/environments.md,
/// "Connection poolers".
pub fn use_unnamed_statements(unnamed: bool) {
    NAMED_STATEMENTS.store(!unnamed, Ordering::Relaxed);
}

/// Whether statements are named and cached (see [`use_unnamed_statements`]): what each query
/// passes to sqlx's `persistent`.
pub fn named_statements() -> bool {
    NAMED_STATEMENTS.load(Ordering::Relaxed)
}
