-- The operator's toolkit: paused topics and dispatcher replica heartbeats.

-- A paused topic: its rows keep accumulating and are not claimed until it is resumed. Nothing is
-- dead-lettered or charged for a pause. Every replica's claims read this table, so a pause takes
-- effect at the next claim.
CREATE TABLE pubsub_outbox_paused_topic (
    topic     TEXT        PRIMARY KEY,
    paused_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    paused_by TEXT        NOT NULL CHECK (paused_by <> ''),
    reason    TEXT        NOT NULL CHECK (reason <> '')
);

-- One row per running dispatcher process, refreshed every few seconds (row locks are invisible to
-- other connections, so this is how `status` sees the replicas). A row whose heartbeat is old
-- belongs to a replica that is gone; a clean shutdown deletes its row.
CREATE TABLE pubsub_outbox_replica (
    replica_id     TEXT        PRIMARY KEY,
    hostname       TEXT        NOT NULL,
    pid            INTEGER     NOT NULL,
    version        TEXT        NOT NULL,
    topics         TEXT[],
    started_at     TIMESTAMPTZ NOT NULL,
    heartbeat_at   TIMESTAMPTZ NOT NULL,
    breaker_open   BOOLEAN     NOT NULL DEFAULT false,
    batches_in_flight INTEGER  NOT NULL DEFAULT 0,
    rows_in_flight INTEGER     NOT NULL DEFAULT 0
);

-- The producer remembers the dedupe keys of streams with a lookback (20261201000011).
GRANT SELECT, INSERT, DELETE ON producer_lookback_key TO outbox_producer;

-- The dispatcher reads pauses and keeps its heartbeat row.
GRANT SELECT ON pubsub_outbox_paused_topic TO outbox_dispatcher;
GRANT SELECT, INSERT, UPDATE, DELETE ON pubsub_outbox_replica TO outbox_dispatcher;

-- Operators (people, through `dispatcher status|dead-letters|pause|resume|audit` and
-- `producer streams|rewind`) log in as IAM users that are members of this group: they read
-- everything, move dead letters back or away, pause topics, rewind watermarks, and write the
-- audit trail in the same transaction as each action. The role comes from
-- deploy/sql/bootstrap.sql, like the workload roles.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_operator') THEN
        RAISE EXCEPTION 'role outbox_operator does not exist: run deploy/sql/bootstrap.sql in this database as an administrator (a role with CREATEROLE), then migrate again'
            USING ERRCODE = 'undefined_object';
    END IF;
END
$$;
GRANT SELECT, INSERT ON pubsub_outbox TO outbox_operator;
-- A replayed dead letter without its original id takes a new one.
GRANT USAGE ON SEQUENCE pubsub_outbox_id_seq TO outbox_operator;
GRANT SELECT, DELETE ON pubsub_outbox_dead_letter TO outbox_operator;
GRANT SELECT, INSERT, DELETE ON pubsub_outbox_paused_topic TO outbox_operator;
GRANT SELECT ON pubsub_outbox_replica TO outbox_operator;
GRANT SELECT, INSERT ON pubsub_outbox_audit TO outbox_operator;
GRANT SELECT, UPDATE ON producer_watermark TO outbox_operator;
GRANT SELECT ON producer_run TO outbox_operator;
