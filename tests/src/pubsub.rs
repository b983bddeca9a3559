//! A topic and subscription per test on the Pub/Sub emulator, and pulling everything back.

use std::collections::HashMap;
use std::time::Duration;

use google_cloud_pubsub::client::{SchemaService, Subscriber, SubscriptionAdmin, TopicAdmin};
use google_cloud_pubsub::model::{Encoding, Schema, SchemaSettings, schema};
use google_cloud_pubsub::subscriber::MessageStream;

use crate::env;
use crate::ledger::Arrival;

/// A message as a subscriber received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Received {
    /// Message data.
    pub data: Vec<u8>,
    /// Attributes.
    pub attributes: HashMap<String, String>,
    /// Ordering key ("" when none).
    pub ordering_key: String,
    /// Pub/Sub's message id.
    pub message_id: String,
}

impl Received {
    /// The dedupe attribute (default name).
    pub fn dedupe_key(&self) -> &str {
        self.attributes
            .get(outbox_shared::DEFAULT_DEDUPE_ATTRIBUTE)
            .map_or("", String::as_str)
    }

    /// What the delivery ledger judges.
    pub fn arrival(&self) -> Arrival {
        Arrival {
            dedupe_key: self.dedupe_key().to_owned(),
            ordering_key: self.ordering_key.clone(),
        }
    }
}

/// The ledger's view of `received`, in the order received.
pub fn arrivals(received: &[Received]) -> Vec<Arrival> {
    received.iter().map(Received::arrival).collect()
}

/// `received` in the order the emulator accepted the publishes (it numbers message ids so).
pub fn by_publish_order(received: &[Received]) -> Vec<Received> {
    let mut sorted = received.to_vec();
    sorted.sort_by_key(|m| {
        m.message_id
            .parse::<u64>()
            .expect("emulator message ids are numbers")
    });
    sorted
}

/// How often each dedupe key arrived.
pub fn by_dedupe_key(received: &[Received]) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for m in received {
        *counts.entry(m.dedupe_key().to_owned()).or_insert(0) += 1;
    }
    counts
}

/// The emulator endpoint as an http URL.
pub fn endpoint() -> String {
    format!("http://{}", env::pubsub_emulator_host())
}

fn anonymous() -> google_cloud_auth::credentials::Credentials {
    google_cloud_auth::credentials::anonymous::Builder::new().build()
}

/// A topic with one subscription, deleted on drop.
#[derive(Debug)]
pub struct TestTopic {
    /// Full topic name.
    pub topic: String,
    /// Full subscription name.
    pub subscription: String,
}

/// An Avro schema every message of a [`TestTopic::with_schema`] topic must match (JSON encoding):
/// `{"amount": <int>}`.
pub const INVOICE_SCHEMA: &str =
    r#"{"type": "record", "name": "Invoice", "fields": [{"name": "amount", "type": "int"}]}"#;

impl TestTopic {
    /// Creates a topic and a subscription (message ordering enabled when `ordered`).
    pub async fn new(ordered: bool) -> Self {
        Self::create(ordered, None, 60).await
    }

    /// Like [`Self::new`] with an ack deadline of `seconds` (10 to 600): how soon the messages a
    /// killed consumer held are delivered again.
    pub async fn with_ack_deadline(ordered: bool, seconds: i32) -> Self {
        Self::create(ordered, None, seconds).await
    }

    /// Like [`Self::new`], on a topic that validates every message against [`INVOICE_SCHEMA`]
    /// (Pub/Sub refuses a whole publish request when one of its messages does not match).
    pub async fn with_schema(ordered: bool) -> Self {
        let project = env::pubsub_project();
        let schema = format!("projects/{project}/schemas/{}", env::unique_name("invoice"));
        let client = SchemaService::builder()
            .with_endpoint(endpoint())
            .with_credentials(anonymous())
            .build()
            .await
            .expect("schema client builds");
        let id = schema.rsplit('/').next().unwrap_or_default().to_owned();
        client
            .create_schema()
            .set_parent(format!("projects/{project}"))
            .set_schema_id(id)
            .set_schema(
                Schema::new()
                    .set_type(schema::Type::Avro)
                    .set_definition(INVOICE_SCHEMA),
            )
            .send()
            .await
            .expect("the emulator creates the schema");
        Self::create(ordered, Some(schema), 60).await
    }

    async fn create(ordered: bool, schema: Option<String>, ack_deadline: i32) -> Self {
        let project = env::pubsub_project();
        let topic = format!("projects/{project}/topics/{}", env::unique_name("t"));
        let subscription = format!("projects/{project}/subscriptions/{}", env::unique_name("s"));
        create_topic_with(&topic, schema).await;
        create_subscription(&topic, &subscription, ordered, ack_deadline).await;
        Self {
            topic,
            subscription,
        }
    }

    /// A second subscription on this topic (every message is delivered to each subscription),
    /// deleted on drop.
    pub async fn add_subscription(&self, ordered: bool, ack_deadline: i32) -> TestSubscription {
        let project = env::pubsub_project();
        let name = format!("projects/{project}/subscriptions/{}", env::unique_name("s"));
        create_subscription(&self.topic, &name, ordered, ack_deadline).await;
        TestSubscription { name }
    }

    /// Pulls until `expected` messages arrived or nothing new came for `quiet`; acks everything.
    /// Returns the messages in delivery order.
    pub async fn pull(&self, expected: usize, quiet: Duration) -> Vec<Received> {
        pull(&self.subscription, expected, quiet).await
    }
}

async fn create_subscription(topic: &str, subscription: &str, ordered: bool, ack_deadline: i32) {
    create_subscription_at(&endpoint(), topic, subscription, ordered, ack_deadline).await;
}

/// Creates a subscription on the emulator at `endpoint` (`http://host:port`).
pub async fn create_subscription_at(
    endpoint: &str,
    topic: &str,
    subscription: &str,
    ordered: bool,
    ack_deadline: i32,
) {
    let subs = SubscriptionAdmin::builder()
        .with_endpoint(endpoint)
        .with_credentials(anonymous())
        .build()
        .await
        .expect("subscription admin client builds");
    subs.create_subscription()
        .set_name(subscription)
        .set_topic(topic)
        .set_ack_deadline_seconds(ack_deadline)
        .set_enable_message_ordering(ordered)
        .send()
        .await
        .expect("the emulator creates the subscription (run `scripts/services up`)");
}

/// A subscription made by [`TestTopic::add_subscription`], deleted on drop.
#[derive(Debug)]
pub struct TestSubscription {
    /// Full subscription name.
    pub name: String,
}

impl Drop for TestSubscription {
    fn drop(&mut self) {
        delete_from_emulator(Some(self.name.clone()), None);
    }
}

impl Drop for TestTopic {
    fn drop(&mut self) {
        delete_from_emulator(Some(self.subscription.clone()), Some(self.topic.clone()));
    }
}

/// Deletes a subscription and/or a topic from a drop (see [`crate::detached`]). The emulator
/// keeps unconsumed messages in memory: always delete what we made.
fn delete_from_emulator(subscription: Option<String>, topic: Option<String>) {
    crate::detached::block_on_detached(move || async move {
        if let Some(subscription) = subscription
            && let Ok(subs) = SubscriptionAdmin::builder()
                .with_endpoint(endpoint())
                .with_credentials(anonymous())
                .build()
                .await
        {
            let _ = subs
                .delete_subscription()
                .set_subscription(&subscription)
                .send()
                .await;
        }
        if let Some(topic) = topic
            && let Ok(topics) = TopicAdmin::builder()
                .with_endpoint(endpoint())
                .with_credentials(anonymous())
                .build()
                .await
        {
            let _ = topics.delete_topic().set_topic(&topic).send().await;
        }
    });
}

/// Creates a topic (full name) on the emulator.
pub async fn create_topic(topic: &str) {
    create_topic_with(topic, None).await;
}

async fn create_topic_with(topic: &str, schema: Option<String>) {
    create_topic_at(&endpoint(), topic, schema).await;
}

/// Creates a topic (full name) on the emulator at `endpoint` (`http://host:port`).
pub async fn create_topic_at(endpoint: &str, topic: &str, schema: Option<String>) {
    let topics = TopicAdmin::builder()
        .with_endpoint(endpoint)
        .with_credentials(anonymous())
        .build()
        .await
        .expect("topic admin client builds");
    let settings = schema.map(|s| {
        SchemaSettings::new()
            .set_schema(s)
            .set_encoding(Encoding::Json)
    });
    topics
        .create_topic()
        .set_name(topic)
        .set_or_clear_schema_settings(settings)
        .send()
        .await
        .expect("the emulator creates the topic (run `scripts/services up`)");
}

/// A streaming pull of `subscription` on the emulator, as a consumer opens one.
pub async fn stream(subscription: &str) -> MessageStream {
    stream_at(&endpoint(), subscription).await
}

/// A streaming pull of `subscription` on the emulator at `endpoint` (`http://host:port`).
pub async fn stream_at(endpoint: &str, subscription: &str) -> MessageStream {
    let client = Subscriber::builder()
        .with_endpoint(endpoint)
        .with_credentials(anonymous())
        .build()
        .await
        .expect("subscriber client builds");
    client
        .subscribe(subscription)
        .set_max_outstanding_messages(10_000i64)
        .build()
}

/// Pulls from `subscription` until `expected` messages arrived or nothing new came for `quiet`.
pub async fn pull(subscription: &str, expected: usize, quiet: Duration) -> Vec<Received> {
    let mut stream = stream(subscription).await;
    let mut out = Vec::new();
    while out.len() < expected {
        match tokio::time::timeout(quiet, stream.next()).await {
            Ok(Some(Ok((msg, handler)))) => {
                handler.ack();
                out.push(Received {
                    data: msg.data.to_vec(),
                    attributes: msg.attributes,
                    ordering_key: msg.ordering_key,
                    message_id: msg.message_id,
                });
            }
            Ok(Some(Err(e))) => panic!("pulling from {subscription} failed: {e}"),
            Ok(None) | Err(_) => break,
        }
    }
    // Give the acks a moment to reach the emulator before the stream is dropped.
    tokio::time::sleep(Duration::from_millis(200)).await;
    out
}
