//! Test data: messages, enqueueing them, and reading the outbox back.

use outbox_shared::{NewMessage, enqueue_batch};
use sqlx::PgPool;

/// An unkeyed message whose payload is `payload of <dedupe_key>`, with `attrs`.
pub fn message(topic: &str, dedupe_key: &str, attrs: &[(&str, &str)]) -> NewMessage {
    attrs.iter().fold(
        NewMessage::new(
            topic,
            dedupe_key,
            format!("payload of {dedupe_key}").into_bytes(),
        ),
        |m, (k, v)| m.with_attribute(*k, *v),
    )
}

/// `keys` ordering keys `key-000`… with `per_key` messages each, interleaved across keys and in
/// sequence order within a key; dedupe keys are `k<key>-m<seq>` ([`keyed_dedupe`]).
pub fn keyed_messages(topic: &str, keys: usize, per_key: usize) -> Vec<NewMessage> {
    (0..per_key)
        .flat_map(|seq| (0..keys).map(move |key| (key, seq)))
        .map(|(key, seq)| {
            NewMessage::new(
                topic,
                keyed_dedupe(key, seq),
                format!("{key}:{seq}").into_bytes(),
            )
            .with_ordering_key(format!("key-{key:03}"))
        })
        .collect()
}

/// The dedupe key of message `seq` of key `key` in [`keyed_messages`].
pub fn keyed_dedupe(key: usize, seq: usize) -> String {
    format!("k{key:03}-m{seq:02}")
}

/// Invoice event `i` for the inbox's example consumer (`invoice_consumer`): invoice `inv-<i>`
/// of customer `cust-<i % 7>`, total `<i>.25`, dedupe key `invoice-<i>`, unkeyed.
pub fn invoice_event(topic: &str, i: usize) -> NewMessage {
    let payload = serde_json::json!({
        "order_id": format!("inv-{i}"),
        "customer_id": format!("cust-{}", i % 7),
        "status": "issued",
        "total": format!("{i}.25"),
    });
    NewMessage::new(
        topic,
        format!("invoice-{i}"),
        payload.to_string().into_bytes(),
    )
}

/// Enqueues `messages` in transactions of at most 1,000.
pub async fn enqueue(pool: &PgPool, messages: &[NewMessage]) {
    for chunk in messages.chunks(1000) {
        let mut tx = pool.begin().await.expect("begin");
        enqueue_batch(&mut tx, chunk).await.expect("enqueue");
        tx.commit().await.expect("commit");
    }
}

/// Enqueues `messages` in one transaction that also wakes the dispatchers (NOTIFY), as an
/// application does.
pub async fn enqueue_and_notify(pool: &PgPool, messages: &[NewMessage]) {
    let mut tx = pool.begin().await.expect("begin");
    enqueue_batch(&mut tx, messages).await.expect("enqueue");
    outbox_shared::notify(&mut tx, outbox_shared::DEFAULT_NOTIFY_CHANNEL)
        .await
        .expect("notify");
    tx.commit().await.expect("commit");
}

/// Enqueues `n` messages `m0`… `m<n-1>` on `topic`.
pub async fn enqueue_numbered(pool: &PgPool, topic: &str, n: usize) -> Vec<NewMessage> {
    let msgs: Vec<NewMessage> = (0..n)
        .map(|i| message(topic, &format!("m{i}"), &[]))
        .collect();
    enqueue(pool, &msgs).await;
    msgs
}

/// The one number `sql` selects.
pub async fn count(pool: &PgPool, sql: &str) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(pool)
        .await
        .unwrap_or_else(|e| panic!("count query {sql:?} failed: {e}"))
}

/// Rows in the outbox (published and retained ones included).
pub async fn outbox_rows(pool: &PgPool) -> i64 {
    count(pool, "SELECT count(*) FROM pubsub_outbox").await
}

/// Rows not yet published.
pub async fn unpublished_rows(pool: &PgPool) -> i64 {
    count(
        pool,
        "SELECT count(*) FROM pubsub_outbox WHERE published_at IS NULL",
    )
    .await
}

/// Rows in the dead-letter table.
pub async fn dead_letters(pool: &PgPool) -> i64 {
    count(pool, "SELECT count(*) FROM pubsub_outbox_dead_letter").await
}

/// The dedupe keys left in the outbox, in id order.
pub async fn outbox_dedupe_keys(pool: &PgPool) -> Vec<String> {
    sqlx::query_scalar("SELECT dedupe_key FROM pubsub_outbox ORDER BY id")
        .fetch_all(pool)
        .await
        .expect("outbox rows")
}

/// Inserts a dead letter as the dispatcher writes one (permanent, one attempt); returns its id.
pub async fn dead_letter(
    pool: &PgPool,
    topic: &str,
    key: Option<&str>,
    payload: &[u8],
    error: &str,
) -> i64 {
    sqlx::query_scalar(
        "INSERT INTO pubsub_outbox_dead_letter (topic, ordering_key, dedupe_key, payload, created_at,
                                                attempts, error_kind, last_error, source)
         VALUES ($1, $2, 'dl-' || gen_random_uuid(), $3, now(), 1, 'permanent', $4, 'dispatcher')
         RETURNING id",
    )
    .bind(topic)
    .bind(key)
    .bind(payload)
    .bind(error)
    .fetch_one(pool)
    .await
    .expect("insert a dead letter")
}
