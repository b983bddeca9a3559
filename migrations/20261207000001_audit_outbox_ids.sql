-- A replay's audit row records where each dead letter went: `outbox_ids[i]` is the outbox id
-- `row_ids[i]` went back to, so `dead-letters show` of a replayed id follows it, while the
-- selector stays the filter as given (before, a replay kept this map in its selector, which a
-- large replay made thousands of characters long). NULL for every other action and for the rows
-- of a release before 0.2.0, which runs unchanged on this schema (its inserts name their
-- columns).
ALTER TABLE pubsub_outbox_audit ADD COLUMN IF NOT EXISTS outbox_ids BIGINT[];
