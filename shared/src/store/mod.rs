//! All SQL of the project, one module per table. Nothing outside this module writes SQL.
//!
//! Functions take `&mut PgConnection` (a transaction derefs to one) so callers decide the
//! transaction boundaries: the producer enqueues and advances its watermark atomically; the
//! dispatcher claims and settles inside one transaction.

pub mod audit;
pub mod claim;
pub mod dead_letter;
pub mod lookback;
pub mod notify;
pub mod outbox;
pub mod pause;
pub mod replica;
pub mod run_ledger;
pub mod settle;
pub mod status;
pub mod watermark;
