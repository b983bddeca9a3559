-- Messages that will not be published without an operator: permanently rejected by Pub/Sub, out of
-- attempts, or rejected before enqueue (limits). Operators inspect, replay (back into the outbox) or
-- discard them; every such action is written to pubsub_outbox_audit.
CREATE TABLE pubsub_outbox_dead_letter (
    id                BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- The outbox row it came from; NULL when the producer rejected it before enqueue.
    outbox_id         BIGINT,
    topic             TEXT        NOT NULL,
    ordering_key      TEXT,
    dedupe_key        TEXT        NOT NULL,
    payload           BYTEA       NOT NULL,
    attributes        JSONB       NOT NULL DEFAULT '{}'::jsonb,
    created_at        TIMESTAMPTZ NOT NULL,
    failed_at         TIMESTAMPTZ NOT NULL DEFAULT now(),
    attempts          INTEGER     NOT NULL,
    -- permanent: Pub/Sub or a local limit check refused it; exhausted: transient failures outlasted
    -- max attempts; rejected: the producer refused it before enqueue.
    error_kind        TEXT        NOT NULL CHECK (error_kind IN ('permanent', 'exhausted', 'rejected')),
    last_error        TEXT        NOT NULL,
    -- Who put it here: 'dispatcher' or 'producer:<stream>'.
    source            TEXT        NOT NULL,
    CONSTRAINT pubsub_outbox_dead_letter_dedupe_key_key UNIQUE (dedupe_key)
);

CREATE INDEX pubsub_outbox_dead_letter_failed_at_idx ON pubsub_outbox_dead_letter (failed_at);

-- Strict ordering: a dead-lettered keyed message blocks its (topic, ordering_key).
CREATE INDEX pubsub_outbox_dead_letter_key_idx
    ON pubsub_outbox_dead_letter (topic, ordering_key)
    WHERE ordering_key IS NOT NULL;
