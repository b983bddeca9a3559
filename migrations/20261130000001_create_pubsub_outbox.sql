-- The outbox: one row per message waiting to be published to Pub/Sub.
--
-- Any application may INSERT here in its own transaction (the producer is only one writer).
-- The dispatcher claims due rows with FOR UPDATE SKIP LOCKED (see ARCHITECTURE.md, "Claim protocol").
CREATE TABLE pubsub_outbox (
    id                BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- Full topic name: projects/<project>/topics/<topic>.
    topic             TEXT        NOT NULL CHECK (topic ~ '^projects/[^/]+/topics/[^/]+$'),
    -- NULL: unordered. Messages sharing (topic, ordering_key) are published in id order.
    ordering_key      TEXT        CHECK (ordering_key <> ''),
    -- Stable across reruns; sent as an attribute so consumers can drop duplicates.
    dedupe_key        TEXT        NOT NULL CHECK (dedupe_key <> ''),
    payload           BYTEA       NOT NULL,
    -- string -> string only (Pub/Sub attributes).
    attributes        JSONB       NOT NULL DEFAULT '{}'::jsonb
                      CHECK (jsonb_typeof(attributes) = 'object'
                             AND NOT jsonb_path_exists(attributes, '$.* ? (@.type() != "string")')),
    -- Durable retry schedule: a restart keeps it.
    attempts          INTEGER     NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    next_attempt_at   TIMESTAMPTZ NOT NULL DEFAULT now(),
    last_error        TEXT,
    -- Lease columns. The default claim protocol holds row locks in an open transaction and leaves
    -- these NULL; they exist for a lease-based claim (claim + commit, settle later) and for operators
    -- (pause: a lease owner of 'paused' far in the future).
    lease_owner       TEXT,
    lease_expires_at  TIMESTAMPTZ,
    created_at        TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- Set only when published rows are retained (dispatcher --retention > 0); otherwise the row is
    -- deleted in the transaction that records the publish.
    published_at      TIMESTAMPTZ,
    pubsub_message_id TEXT,
    CONSTRAINT pubsub_outbox_dedupe_key_key UNIQUE (dedupe_key)
);

-- Unordered claims walk due, unpublished, unkeyed rows in (next_attempt_at, id) order. Partial: rows
-- with an ordering key and retained published rows never enter it.
CREATE INDEX pubsub_outbox_claimable_idx
    ON pubsub_outbox (next_attempt_at, id)
    WHERE published_at IS NULL AND ordering_key IS NULL;

-- Ordered claims walk keys: the head (lowest id) of each (topic, ordering_key) and the rows behind it.
CREATE INDEX pubsub_outbox_key_idx
    ON pubsub_outbox (topic, ordering_key, id)
    WHERE published_at IS NULL AND ordering_key IS NOT NULL;

-- Purging retained published rows in small batches, oldest first.
CREATE INDEX pubsub_outbox_published_idx
    ON pubsub_outbox (published_at)
    WHERE published_at IS NOT NULL;

-- A queue table churns: every message is one insert and one delete (or update). The default
-- autovacuum trigger (20% of the table dead) never fires on a table that is small when drained and
-- huge when backed up, and dead index entries at the queue head make every claim slower. Vacuum after
-- a fixed number of dead rows, without cost-based sleeping, and keep statistics fresh for the planner.
ALTER TABLE pubsub_outbox SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 20000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 50000,
    autovacuum_vacuum_cost_delay = 0,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 20000
);

COMMENT ON TABLE pubsub_outbox IS
    'Transactional outbox drained to Google Cloud Pub/Sub by pubsub-outbox dispatcher.';
