//! The one integration-test binary: every test runs against real PostgreSQL, the Pub/Sub emulator
//! and bqemulator (start them with `scripts/services up`).

mod dispatcher;
mod dispatcher_options;
mod foundation;
mod inbox;
mod ordering;
mod poison;
mod producer;
mod recovery;
mod services;
