//! An application writing to the outbox in its own transaction, linking only the lean contract.
//!
//! ```sh
//! DATABASE_URL=postgres://postgres@127.0.0.1:5432/postgres \
//!   cargo run -p pubsub-outbox-shared --example enqueue
//! ```
//!
//! `cargo tree -p pubsub-outbox-shared -e normal` shows what an application links: no HTTP
//! server, CLI parser, metrics or log formatter.

use outbox_shared::{DEFAULT_NOTIFY_CHANNEL, NewMessage, enqueue_batch, migrate, notify};

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")
        .map_err(|_| "set DATABASE_URL to the database that holds pubsub_outbox")?;
    let pool = sqlx::PgPool::connect(&url).await?;
    migrate(&pool).await?;

    let mut tx = pool.begin().await?;
    // The application's own change goes here, on `tx`, e.g. UPDATE invoices SET ... .
    let message = NewMessage::new(
        "projects/my-project/topics/invoices",
        "invoice-1001-v3",
        br#"{"invoice": 1001}"#.to_vec(),
    )
    .with_ordering_key("customer-42")
    .with_attribute("type", "invoice.issued");
    let outcome = enqueue_batch(&mut tx, &[message]).await?;
    notify(&mut tx, DEFAULT_NOTIFY_CHANNEL).await?;
    tx.commit().await?;
    println!(
        "enqueued {} message(s), {} already present",
        outcome.inserted, outcome.duplicates
    );
    Ok(())
}
