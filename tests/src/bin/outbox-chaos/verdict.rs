//! The independent side of the run: a subscriber per topic (the official client, streaming pull
//! on ordered subscriptions, straight to the emulator, never through the proxy) that records and
//! acks every arrival, and the judgement of those arrivals against what was committed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow};
use google_cloud_pubsub::client::Subscriber;
use harness::ledger::{Arrival, DeliveryLedger, Verdict};

use crate::faults::FaultRecord;

/// One arrival.
#[derive(Debug, Clone)]
pub struct Rec {
    pub dedupe: String,
    pub key: String,
    /// The emulator's message id (numbered in accept order).
    pub message_id: u64,
    /// When it arrived, since the load started.
    pub at: Duration,
}

/// Every arrival so far, in arrival order.
pub type Arrivals = Arc<Mutex<Vec<Rec>>>;

/// Records (and acks) every message of `subscription` until aborted; reconnects after an error.
/// The dedupe keys also go to `keys` when given (the inbox consumer's expectation).
pub fn subscribe(
    subscription: String,
    arrivals: Arrivals,
    keys: Option<crate::inbox::Delivered>,
    t0: Instant,
) -> tokio::task::JoinHandle<Result<()>> {
    tokio::spawn(async move {
        let client = Subscriber::builder()
            .with_endpoint(harness::pubsub::endpoint())
            .with_credentials(google_cloud_auth::credentials::anonymous::Builder::new().build())
            .build()
            .await?;
        loop {
            let mut stream = client
                .subscribe(&subscription)
                .set_max_outstanding_messages(20_000i64)
                .build();
            while let Some(next) = stream.next().await {
                match next {
                    Ok((msg, handler)) => {
                        handler.ack();
                        let message_id = msg.message_id.parse().map_err(|_| {
                            anyhow!(
                                "the emulator sent a non-numeric message id {:?}",
                                msg.message_id
                            )
                        })?;
                        let rec = Rec {
                            dedupe: msg
                                .attributes
                                .get(outbox_shared::DEFAULT_DEDUPE_ATTRIBUTE)
                                .cloned()
                                .unwrap_or_default(),
                            key: msg.ordering_key,
                            message_id,
                            at: t0.elapsed(),
                        };
                        if let Some(keys) = &keys {
                            keys.lock()
                                .map_err(|_| anyhow!("delivered keys lock poisoned"))?
                                .insert(rec.dedupe.clone());
                        }
                        arrivals
                            .lock()
                            .map_err(|_| anyhow!("arrivals lock poisoned"))?
                            .push(rec);
                    }
                    Err(e) => {
                        eprintln!("outbox-chaos: subscriber on {subscription}: {e}; reconnecting");
                        break;
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
}

/// The ledger's verdict in arrival order and in Pub/Sub publish order (message ids).
pub fn judge(ledger: &DeliveryLedger, arrivals: &[Rec]) -> (Verdict, Verdict) {
    let as_arrival = |r: &Rec| Arrival {
        dedupe_key: r.dedupe.clone(),
        ordering_key: r.key.clone(),
    };
    let in_arrival_order: Vec<Arrival> = arrivals.iter().map(as_arrival).collect();
    let mut by_id: Vec<&Rec> = arrivals.iter().collect();
    by_id.sort_by_key(|r| r.message_id);
    let in_publish_order: Vec<Arrival> = by_id.into_iter().map(as_arrival).collect();
    (
        ledger.verdict(&in_arrival_order),
        ledger.verdict(&in_publish_order),
    )
}

/// Duplicates by likely cause. The same message id again is Pub/Sub redelivering (an ack that
/// did not reach it in time), not a second publish. Otherwise the first copy of a duplicated message arrived just before (or
/// during) a dispatcher kill (a batch in flight), a PostgreSQL restart (a lost settle commit) or a
/// Pub/Sub outage (an abandoned publish the client delivered anyway). Windows: up to the publish
/// timeout (10 s) before the fault, up to 10 s after its heal for outages (held requests drain
/// then), 2 s otherwise.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Attribution {
    pub redelivered: usize,
    pub kill: usize,
    pub postgres_restart: usize,
    pub outage: usize,
    pub other: usize,
}

pub fn attribute_duplicates(arrivals: &[Rec], faults: &[FaultRecord]) -> Attribution {
    let mut first: HashMap<&str, Duration> = HashMap::new();
    let mut ids = std::collections::HashSet::new();
    let mut dups: Vec<&str> = Vec::new();
    let mut a = Attribution::default();
    for r in arrivals {
        if !ids.insert(r.message_id) {
            a.redelivered += 1;
        } else if first.contains_key(r.dedupe.as_str()) {
            dups.push(&r.dedupe);
        } else {
            first.insert(&r.dedupe, r.at);
        }
    }
    let before = Duration::from_secs(10);
    for d in dups {
        let t = first[d];
        let hit = |kinds: &[&str], after: Duration| {
            faults
                .iter()
                .any(|f| kinds.contains(&f.kind) && t + before >= f.at && t <= f.healed + after)
        };
        if hit(&["dispatcher_kill"], Duration::from_secs(2)) {
            a.kill += 1;
        } else if hit(&["postgres_restart"], Duration::from_secs(2)) {
            a.postgres_restart += 1;
        } else if hit(&["pubsub_cut", "pubsub_stall"], Duration::from_secs(10)) {
            a.outage += 1;
        } else {
            a.other += 1;
        }
    }
    a
}

/// Time from each fault's heal to the first arrival after it.
pub fn recovery(arrivals_by_time: &[Duration], f: &FaultRecord) -> Option<Duration> {
    let i = arrivals_by_time.partition_point(|t| *t < f.healed);
    arrivals_by_time.get(i).map(|t| *t - f.healed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(dedupe: &str, key: &str, id: u64, at_ms: u64) -> Rec {
        Rec {
            dedupe: dedupe.into(),
            key: key.into(),
            message_id: id,
            at: Duration::from_millis(at_ms),
        }
    }

    #[test]
    fn an_order_swap_in_publish_order_is_caught_even_when_arrivals_look_fine() {
        let mut l = DeliveryLedger::new();
        l.enqueued("a1", Some("a"));
        l.enqueued("a2", Some("a"));
        // Arrived in order, but a2 was accepted by Pub/Sub before a1.
        let (arrival, publish) = judge(&l, &[rec("a1", "a", 9, 1), rec("a2", "a", 3, 2)]);
        assert!(arrival.is_clean(), "{arrival:?}");
        assert_eq!(publish.order_violations.len(), 1, "{publish:?}");
    }

    #[test]
    fn duplicates_are_attributed_to_the_fault_around_their_first_copy() {
        let kill = FaultRecord {
            kind: "dispatcher_kill",
            at: Duration::from_secs(30),
            healed: Duration::from_secs(32),
            detail: String::new(),
            hit_in_flight: Some(true),
        };
        let arrivals = [
            rec("m1", "", 1, 29_000),
            rec("m2", "", 2, 60_000),
            rec("m1", "", 3, 33_000),
            rec("m2", "", 4, 61_000),
            rec("m2", "", 4, 62_000),
        ];
        let a = attribute_duplicates(&arrivals, std::slice::from_ref(&kill));
        assert_eq!(
            a,
            Attribution {
                redelivered: 1,
                kill: 1,
                other: 1,
                ..Attribution::default()
            }
        );
        let times = [Duration::from_secs(31), Duration::from_secs(35)];
        assert_eq!(recovery(&times, &kill), Some(Duration::from_secs(3)));
    }
}
