//! Refusals: what holds the dispatcher back, and why, each as state its workers share
//! (`crate::batch::dispatch`) and learn into from every batch:
//!
//! - [`hold`]: a topic Pub/Sub refuses as a whole is held, never dead-lettered (its probes are a
//!   background task: `crate::tasks::hold_watch`);
//! - [`storm`]: a topic whose messages Pub/Sub keeps refusing sends its unkeyed rows in parts;
//! - [`pace`]: quota slows a topic down, charging no attempt;
//! - [`breaker`]: claiming pauses while Pub/Sub is unreachable for everyone;
//! - [`schema`]: claiming waits while the database's schema is behind this release.
//!
//! Invariants: a refusal that is not the message's fault never costs the message an attempt nor
//! sends it to the dead letters; each state here is memory of this process only (what must
//! outlive it, a hold, is written by the batch that saw it); none of it runs a batch.

pub(crate) mod breaker;
pub(crate) mod hold;
pub(crate) mod pace;
pub(crate) mod schema;
pub(crate) mod storm;
