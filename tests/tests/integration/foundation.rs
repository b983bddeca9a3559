//! Foundation: the schema, the harness and the local services work.

use std::time::Duration;

use google_cloud_pubsub::client::Publisher;
use google_cloud_pubsub::model::Message;
use harness::db::TestDb;
use harness::pubsub::{TestTopic, endpoint};

#[tokio::test]
async fn migrations_apply_to_an_empty_database_and_are_idempotent() {
    let db = TestDb::empty().await;
    outbox_shared::db::migrate(&db.pool)
        .await
        .expect("first migration run succeeds");
    outbox_shared::db::migrate(&db.pool)
        .await
        .expect("second migration run is a no-op");

    // The outbox's own bookkeeping (never sqlx's `_sqlx_migrations`, which the application owns).
    let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM pubsub_outbox_migrations")
        .fetch_one(&db.pool)
        .await
        .expect("read the migration ledger");
    assert_eq!(
        applied as usize,
        outbox_shared::db::MIGRATOR.iter().count(),
        "each migration applied once"
    );

    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables WHERE table_schema = 'public' ORDER BY 1",
    )
    .fetch_all(&db.pool)
    .await
    .expect("list tables");
    for t in [
        "producer_run",
        "producer_watermark",
        "pubsub_outbox",
        "pubsub_outbox_audit",
        "pubsub_outbox_dead_letter",
    ] {
        assert!(
            tables.iter().any(|x| x == t),
            "table {t} exists; found {tables:?}"
        );
    }

    let options: Vec<String> = sqlx::query_scalar(
        "SELECT unnest(reloptions) FROM pg_class WHERE relname = 'pubsub_outbox'",
    )
    .fetch_all(&db.pool)
    .await
    .expect("read reloptions");
    assert!(
        options.contains(&"autovacuum_vacuum_scale_factor=0".to_owned()),
        "queue autovacuum settings applied: {options:?}"
    );
}

#[tokio::test]
async fn the_schema_refuses_attributes_that_are_not_strings() {
    let db = TestDb::new().await;
    let err = sqlx::query(
        "INSERT INTO pubsub_outbox (topic, dedupe_key, payload, attributes)
         VALUES ('projects/p/topics/t', 'd1', '\\x00', '{\"n\": 1}')",
    )
    .execute(&db.pool)
    .await
    .expect_err("a numeric attribute value violates the check constraint");
    assert!(err.to_string().contains("check constraint"), "{err}");
}

#[tokio::test]
async fn the_harness_publishes_to_and_pulls_from_a_fresh_emulator_topic() {
    let topic = TestTopic::new(false).await;
    let publisher = Publisher::builder(&topic.topic)
        .with_endpoint(endpoint())
        .with_credentials(google_cloud_auth::credentials::anonymous::Builder::new().build())
        .build()
        .await
        .expect("publisher builds");
    let mut ids = Vec::new();
    for i in 0..5 {
        let id = publisher
            .publish(
                Message::new()
                    .set_data(format!("hello {i}"))
                    .set_attributes([("n", i.to_string())]),
            )
            .await
            .expect("the emulator accepts the publish");
        ids.push(id);
    }
    let got = topic.pull(5, Duration::from_secs(10)).await;
    let mut data: Vec<String> = got
        .iter()
        .map(|m| String::from_utf8_lossy(&m.data).into_owned())
        .collect();
    data.sort();
    assert_eq!(
        data,
        (0..5).map(|i| format!("hello {i}")).collect::<Vec<_>>(),
        "every published message was pulled"
    );
    assert!(
        got.iter().all(|m| ids.contains(&m.message_id)),
        "message ids match the publish results"
    );
}

#[tokio::test]
async fn an_unreachable_database_fails_with_an_error_naming_the_url_and_what_to_check() {
    let refused = harness::process::ReservedPort::new();
    let port = refused.port();
    let args = outbox_runtime::db::DatabaseArgs {
        url: format!("postgres://outbox:s3cret@127.0.0.1:{port}/outbox"),
        pool_size: 1,
        connect_timeout: Duration::from_millis(500),
        pooler: outbox_runtime::db::Pooler::None,
    };
    let err = outbox_runtime::db::connect(&args, "test")
        .await
        .expect_err("nothing listens there");
    let text = err.to_string();
    assert!(
        text.contains(&format!("127.0.0.1:{port}")),
        "names the address: {text}"
    );
    assert!(
        !text.contains("s3cret"),
        "never prints the password: {text}"
    );
    assert!(
        text.contains("Check DATABASE_URL"),
        "says what to do: {text}"
    );
}
