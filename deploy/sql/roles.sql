-- The outbox's NOLOGIN group roles, created if missing. Plain SQL (no psql variables), so it runs
-- anywhere: deploy/sql/bootstrap.sql includes it, and the test harness runs it on its cluster.
-- Needs CREATEROLE (Cloud SQL: the built-in `postgres` user, a member of cloudsqlsuperuser); the
-- migrations never create a role, they stop with "run deploy/sql/bootstrap.sql" when one is
-- missing. Roles are cluster-wide and many databases may be set up at once (the tests do), so a
-- concurrent CREATE ROLE that loses the race is ignored (duplicate_object, or unique_violation on
-- pg_authid's name index).
--
--   outbox_dispatcher  the dispatcher: claims, settles, dead-letters
--   outbox_producer    the producer (and any application that enqueues): inserts only
--   outbox_operator    the people on call: the operator commands, each with its audit row
DO $$
DECLARE
    role_name text;
BEGIN
    FOREACH role_name IN ARRAY ARRAY['outbox_dispatcher', 'outbox_producer', 'outbox_operator'] LOOP
        BEGIN
            IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = role_name) THEN
                EXECUTE format('CREATE ROLE %I NOLOGIN', role_name);
            END IF;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;
        END;
    END LOOP;
END
$$;
