//! The Pub/Sub path: everything between a claimed batch and Pub/Sub's answer, below everything
//! that dispatches (it knows no outbox state: no pool, no worker, no refusal).
//!
//! - [`publish`]: the seam ([`publish::Publish`]: publish a batch, one result per message in
//!   order; probe whether the broker answers) and what became of each message (`Attempt`);
//! - [`publisher`]: it on Pub/Sub's own transport: [`plan`] cuts the batch into requests (one
//!   topic and at most one ordering key each, at most 1,000 messages and 10 MB encoded),
//!   [`transport`] makes the gRPC calls on tonic (connections, credentials, headers), [`wire`]
//!   encodes them, [`trace`] continues the writers' traces through them (send spans);
//! - [`classify`]: what a failure means (transient, permanent, topic refused, throttled, not
//!   attempted), one table of gRPC codes;
//! - [`fault`]: fault injection in front of a publisher (`--inject-failure-rate`, tests).
//!
//! Invariants: a call's messages share no request with another call's (a message refused in a
//! call alone is refused for itself: isolation stands on it); nothing is retried here (the row's
//! durable schedule retries); every message gets exactly one result, in the batch's order.

pub mod classify;
pub mod fault;
pub(crate) mod plan;
pub mod publish;
pub mod publisher;
pub(crate) mod trace;
pub mod transport;
pub(crate) mod wire;
