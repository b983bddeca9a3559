-- The inbox: one row per (consumer, dedupe key) whose handler committed. Applied by
-- `outbox_inbox::migrate` (once per database); idempotent, so any other migration tool can run
-- this file too.
--
-- consumer: the subscription (or consumer) name; two consumers of one topic each process a
-- message once. dedupe_key: the `dedupe_key` attribute every outbox message carries.
CREATE TABLE IF NOT EXISTS pubsub_inbox (
    consumer     text        NOT NULL,
    dedupe_key   text        NOT NULL,
    processed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, dedupe_key)
);

-- Retention purges the oldest rows first, in small batches.
CREATE INDEX IF NOT EXISTS pubsub_inbox_processed_at ON pubsub_inbox (processed_at);

-- Every processed message inserts a row and retention deletes it later: vacuum often, like the
-- outbox (a fixed threshold instead of a fraction of a table that may hold millions of rows).
ALTER TABLE pubsub_inbox SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 20000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 20000
);
