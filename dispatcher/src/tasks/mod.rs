//! The service's background tasks, one file each: the HTTP endpoints ([`health`]), LISTEN
//! ([`listen`]), the gauges ([`gauges`]), the held topics' watch and probes ([`hold_watch`]), the
//! replica heartbeat ([`heartbeat`]) and the purge of retained rows ([`purge`]); [`spawn`] starts
//! them with the schema gate's re-check (`crate::refusals::schema`) and the floors' upkeep
//! (`crate::floors::upkeep`), which live with the state they keep.
//!
//! Each runs until shutdown and logs (never returns) its errors; none claims or settles a row but
//! the held topics' probes, which run the unit of work itself (`crate::batch::probe_held`). Those
//! that read the outbox's tables wait while the schema is behind this release.

pub(crate) mod gauges;
pub(crate) mod health;
pub(crate) mod heartbeat;
pub(crate) mod hold_watch;
pub(crate) mod listen;
pub(crate) mod purge;

use std::sync::Arc;

use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinSet;

use outbox_runtime::health::Checks;
use outbox_runtime::shutdown::Shutdown;

use crate::batch::dispatch::Dispatch;
use crate::config::DispatcherConfig;
use crate::floors::upkeep::{self, Upkeep};
use crate::pubsub::publish::Publish;
use crate::refusals::schema;

/// Starts the endpoints, LISTEN, the schema's re-check, the gauges, the held topics' watch, the
/// floors' upkeep and the purge, each until shutdown (the heartbeat is the service's own: it
/// outlives the others by its last write).
pub(crate) fn spawn<P: Publish>(
    dispatch: &Arc<Dispatch<P>>,
    config: &DispatcherConfig,
    registry: Arc<Registry>,
    listener: TcpListener,
    wakeup: &Arc<Notify>,
    shutdown: &Shutdown,
) -> JoinSet<()> {
    let pool = dispatch.pool.clone();
    let mut background = JoinSet::new();
    let checks = Checks {
        live: health::liveness(dispatch.clone(), config.liveness_timeout),
        ready: health::readiness(
            pool.clone(),
            dispatch.breaker.clone(),
            dispatch.schema.clone(),
        ),
    };
    background.spawn(health::health_server(
        listener,
        registry,
        checks,
        shutdown.clone(),
    ));
    if let Some(channel) = &config.notify_channel {
        background.spawn(listen::listen(
            pool.clone(),
            channel.clone(),
            config.idle.notify_coalesce,
            wakeup.clone(),
            shutdown.clone(),
        ));
    }
    background.spawn(schema::watch(
        dispatch.schema.clone(),
        pool.clone(),
        shutdown.clone(),
    ));
    background.spawn(gauges::sample_gauges(
        pool.clone(),
        dispatch.schema.clone(),
        dispatch.metrics.clone(),
        config.batch.topics.clone(),
        config.batch.skip_dead_letter_topics.clone(),
        shutdown.clone(),
    ));
    background.spawn(hold_watch::watch(dispatch.clone(), shutdown.clone()));
    let upkeep = Upkeep {
        floors: dispatch.floors.clone(),
        pool: pool.clone(),
        session: dispatch.claim_session.clone(),
        schema: dispatch.schema.clone(),
        metrics: dispatch.metrics.clone(),
        topics: config.batch.topics.clone(),
        max_old_keys: usize::try_from(config.batch.key_scan_limit).unwrap_or(usize::MAX),
        left_alone: Box::new({
            let d = dispatch.clone();
            move || d.left_alone()
        }),
    };
    background.spawn(upkeep::keep(
        upkeep,
        config.claim_probe_interval,
        shutdown.clone(),
    ));
    if !config.retention.is_zero() {
        background.spawn(purge::purge(
            pool,
            dispatch.schema.clone(),
            config.retention,
            config.purge_interval,
            shutdown.clone(),
        ));
    }
    background
}
