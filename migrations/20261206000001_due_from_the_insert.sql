-- A row is due from its insert, not from its transaction's start (issue #49;
-- shared/src/store/claim/settled.rs). The claims' unkeyed floor may rise to the instant of a
-- settled stamp: once every transaction that held a row lock mode on the outbox then has ended,
-- a row inserted later must be due after it. `now()` is the transaction's start, so a business
-- transaction that inserts its outbox row at its end, after a slow call, wrote a row due before
-- rows committed long before it; `clock_timestamp()` is evaluated by the INSERT itself, after it
-- took the table's lock. `created_at` keeps `now()`: the writer's transaction time.
--
-- Only the column's default changes (no rewrite, no scan), but ALTER TABLE waits for
-- ACCESS EXCLUSIVE and every later INSERT would queue behind it: it gives up after a few seconds
-- instead (run migrate again once the blocking transaction ended). Release N's binaries never
-- read the default: they run unchanged on this schema.
SET LOCAL lock_timeout = '5s';
ALTER TABLE pubsub_outbox ALTER COLUMN next_attempt_at SET DEFAULT clock_timestamp();
