-- Operator actions (replay, discard, pause, resume, purge…): what, which rows, who, why, when.
CREATE TABLE pubsub_outbox_audit (
    id         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    at         TIMESTAMPTZ NOT NULL DEFAULT now(),
    actor      TEXT        NOT NULL CHECK (actor <> ''),
    action     TEXT        NOT NULL CHECK (action <> ''),
    -- The selection the operator gave (ids, topic, key, time range…), as given.
    selector   JSONB       NOT NULL DEFAULT '{}'::jsonb,
    -- The row ids actually affected.
    row_ids    BIGINT[]    NOT NULL DEFAULT '{}',
    row_count  INTEGER     NOT NULL DEFAULT 0,
    reason     TEXT        NOT NULL CHECK (reason <> '')
);

CREATE INDEX pubsub_outbox_audit_at_idx ON pubsub_outbox_audit (at);
