-- The operator's verbs for messages not yet sent (dispatcher/src/ops/pending.rs): `pending
-- cancel` moves unpublished rows to the dead-letter table as `cancelled` (with the person's
-- reason: inspectable and replayable there, and blocking nothing: the later messages of its key
-- go on, it was a person's decision); `pending retry-now` makes rows waiting for a retry due now.
--
-- A wider CHECK, not a new column: a cancelled message is a dead letter of a fourth kind. Every
-- query that asks whether a dead letter blocks its key leaves `cancelled` out (the claims, the
-- backlog, status). A dispatcher of an older release on this schema would still count one as
-- blocking until it is upgraded: cancel keyed messages after the rollout.
ALTER TABLE pubsub_outbox_dead_letter
    DROP CONSTRAINT pubsub_outbox_dead_letter_error_kind_check;
ALTER TABLE pubsub_outbox_dead_letter
    ADD CONSTRAINT pubsub_outbox_dead_letter_error_kind_check
    CHECK (error_kind IN ('permanent', 'exhausted', 'rejected', 'cancelled'));

-- Operators cancel (lock, delete, insert the dead letter) and retry (lock, set the due time).
-- Locking a row (FOR UPDATE) needs UPDATE on a column; the due time is the only one they change.
GRANT UPDATE (next_attempt_at), DELETE ON pubsub_outbox TO outbox_operator;
GRANT INSERT ON pubsub_outbox_dead_letter TO outbox_operator;
