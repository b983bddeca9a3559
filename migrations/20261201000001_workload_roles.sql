-- Least-privilege group roles for the two workloads. The schema owner (the role that runs the
-- migrations) keeps DDL; the workloads get only the DML their statements need, and log in as IAM
-- database users that are members of these roles (deploy/README.md, "Database roles").
--
-- The roles are NOLOGIN groups and cluster-wide. They are created beforehand, by an administrator,
-- with deploy/sql/bootstrap.sql (locally and in the tests: deploy/sql/roles.sql), so the migrating
-- role needs no CREATEROLE (on Cloud SQL it has none). A missing role stops the migration with
-- the fix, before anything is changed.
DO $$
DECLARE
    role_name text;
BEGIN
    FOREACH role_name IN ARRAY ARRAY['outbox_dispatcher', 'outbox_producer'] LOOP
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = role_name) THEN
            RAISE EXCEPTION 'role % does not exist: run deploy/sql/bootstrap.sql in this database as an administrator (a role with CREATEROLE), then migrate again', role_name
                USING ERRCODE = 'undefined_object';
        END IF;
    END LOOP;
END
$$;

-- USAGE on schema public: PUBLIC has it by default; deploy/sql/bootstrap.sql grants it as well
-- (the migration role does not own the schema on Cloud SQL, so it could not grant it here).

-- The dispatcher claims (SELECT … FOR UPDATE needs UPDATE), settles (UPDATE, DELETE) and moves
-- failures to the dead-letter table (INSERT … ON CONFLICT DO UPDATE: INSERT, UPDATE and SELECT).
-- It reads the dead-letter table for blocked ordering keys and the dead-letter gauges. It never
-- touches the producer's tables, and replay/discard/audit are operator actions, not its own.
GRANT SELECT, UPDATE, DELETE ON pubsub_outbox TO outbox_dispatcher;
GRANT SELECT, INSERT, UPDATE ON pubsub_outbox_dead_letter TO outbox_dispatcher;

-- The producer enqueues and dead-letters the rows it rejects, both with INSERT … ON CONFLICT
-- (dedupe_key) DO NOTHING, which needs SELECT on the conflict column only: it cannot read
-- payloads back. It keeps its watermark (an upsert) and run ledger (INSERT … RETURNING id, then
-- UPDATE by id). An application that enqueues needs the same two grants on pubsub_outbox.
GRANT INSERT, SELECT (dedupe_key) ON pubsub_outbox TO outbox_producer;
GRANT INSERT, SELECT (dedupe_key) ON pubsub_outbox_dead_letter TO outbox_producer;
GRANT SELECT, INSERT, UPDATE ON producer_watermark TO outbox_producer;
GRANT SELECT, INSERT, UPDATE ON producer_run TO outbox_producer;
