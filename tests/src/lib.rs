//! The real-services test harness: PostgreSQL, the Pub/Sub emulator and bqemulator, shared by the
//! integration tests, the benchmarks and the chaos runs.
//!
//! Start the services with `scripts/services up` (the test command in README.md does), which
//! exports the environment read by [`env`]. Every test gets its own database ([`db::TestDb`]) and
//! its own topic and subscription ([`pubsub::TestTopic`]), so tests run in parallel.
//! - [`fixtures`]: messages, enqueueing, outbox counts; [`wait`]: one `wait_until`.
//! - [`dispatcher`]: dispatchers built as the binary builds them, with fast test settings.
//! - [`ledger`]: the delivery verdict (lost, invented, duplicates, per-key order).
//! - [`proxy`]: network failures the real services cannot produce on demand (publish faults:
//!   `outbox_dispatcher::fault`); [`http_faults`]: scripted HTTP failures (HTML 502, bare 503) in
//!   front of bqemulator; [`process`]: every child process (one builder: environment, log file,
//!   the bound address read back from the log); [`operator`]: the operator commands as on-call
//!   runs them; [`grpc_recorder`]: every gRPC call to the emulator recorded (headers, decoded
//!   `Publish` requests), over TLS of a private CA when asked.
//! - [`front_end`]: Google's front end as a dispatcher on GKE meets it (TLS, ADC with a quota
//!   project, the metadata server, refusals by topic, GOAWAY), from the recorder and the token
//!   stand-in.
//! - [`iap`]: a stand-in for Identity-Aware Proxy (its keys, signed assertions) for the console.
//! - [`bigquery`]: tables on bqemulator; [`producer`]: the producer's fixtures (the orders table
//!   and stream, settings, an in-process run, the watermark and outbox reads).

pub mod application;
pub mod bigquery;
pub mod bigquery_standin;
pub mod db;
pub mod detached;
pub mod dispatcher;
pub mod env;
pub mod fixtures;
pub mod front_end;
pub mod grpc_recorder;
pub mod http_faults;
pub mod iap;
pub mod ledger;
pub mod operator;
pub mod otlp;
pub mod pgbouncer;
pub mod process;
pub mod producer;
pub mod proxy;
pub mod pubsub;
pub mod token_server;
pub mod wait;
