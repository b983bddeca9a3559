//! The one integration-test binary: every test runs against real PostgreSQL, the Pub/Sub emulator
//! and bqemulator (start them with `scripts/services up`).

mod autoscaling;
mod console;
mod credentials;
mod dispatcher;
mod dispatcher_options;
mod floors;
mod foundation;
mod inbox;
mod install;
mod migrations;
mod oncall;
mod operator;
mod operator_changes;
mod operator_rules;
mod ordering;
mod pending;
mod plans;
mod poison;
mod pooler;
mod producer;
mod producer_ops;
mod producer_pages;
mod recovery;
mod refusals;
mod releases;
mod schema;
mod services;
mod sidecar;
mod throughput;
mod traces;
mod transport;
mod upgrade;
mod writers_at_random;
