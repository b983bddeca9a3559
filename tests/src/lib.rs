//! The real-services test harness: PostgreSQL, the Pub/Sub emulator and bqemulator.
//!
//! Start the services with `scripts/services up` (the test command in README.md does), which
//! exports the environment read by [`env`]. Every test gets its own database ([`db::TestDb`]) and
//! its own topic and subscription ([`pubsub::TestTopic`]), so tests run in parallel.
//! [`proxy`] adds network failures the real services cannot produce on demand (publish faults:
//! `outbox_dispatcher::chaos`); [`process`] runs the binaries for signal tests.

pub mod bigquery;
pub mod db;
pub mod env;
pub mod process;
pub mod proxy;
pub mod pubsub;
