-- A topic Pub/Sub refuses as a whole is held, not dead-lettered (dispatcher/src/hold.rs): while an
-- IAM grant propagates (PERMISSION_DENIED), before a topic exists (NOT_FOUND), while its CMEK key
-- is disabled (FAILED_PRECONDITION) or a proxy does not route it (UNIMPLEMENTED), every request to
-- it fails alike and no message is at fault. Its rows wait untouched (no attempt charged, no key
-- blocked, every key's order kept), the other topics flow, and one replica at a time probes it by
-- publishing its head message, on an interval that doubles up to a bound; the first accepted
-- probe deletes the row here and the topic's rows flow again.
--
-- One row per held topic: what Pub/Sub said (code and message), since when, how often, and when a
-- probe is due next. A table rather than each replica's memory: `status`, the console and the
-- gauges (the paging alert) read it; every replica skips the topic, a restarted one too; and the
-- probes of all replicas share one schedule (a replica takes a probe by moving next_probe_at).
CREATE TABLE pubsub_outbox_held_topic (
    topic             TEXT        PRIMARY KEY,
    code              TEXT        NOT NULL CHECK (code <> ''),
    message           TEXT        NOT NULL,
    held_since        TIMESTAMPTZ NOT NULL,
    last_refused_at   TIMESTAMPTZ NOT NULL,
    refusals          BIGINT      NOT NULL DEFAULT 1,
    probes            BIGINT      NOT NULL DEFAULT 0,
    next_probe_at     TIMESTAMPTZ NOT NULL,
    probe_interval_ms INTEGER     NOT NULL CHECK (probe_interval_ms > 0)
);

COMMENT ON TABLE pubsub_outbox_held_topic IS
    'Topics Pub/Sub refuses as a whole (not a message''s fault): their rows wait untouched until a probe is accepted.';

-- The dispatcher holds, probes and releases topics; a release advances the claim epoch (the
-- held topic's rows sat below the claims' floors while they were skipped). Operators read it.
GRANT SELECT, INSERT, UPDATE, DELETE ON pubsub_outbox_held_topic TO outbox_dispatcher;
GRANT UPDATE ON pubsub_outbox_claim_epoch TO outbox_dispatcher;
GRANT SELECT ON pubsub_outbox_held_topic TO outbox_operator;
