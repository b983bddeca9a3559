-- One-time database bootstrap for pubsub-outbox on Cloud SQL, run by an administrator (a member of
-- cloudsqlsuperuser, e.g. the built-in `postgres` user) in the outbox database, BEFORE the first
-- migration. Idempotent: safe to run again (for example after adding an IAM user).
--
--   psql "host=127.0.0.1 port=5432 dbname=outbox user=postgres" \
--     -v migrator='pubsub-outbox-migrate@PROJECT_ID.iam' \
--     -v dispatcher='pubsub-outbox-dispatcher@PROJECT_ID.iam' \
--     -v producer='pubsub-outbox-producer@PROJECT_ID.iam' \
--     -v ON_ERROR_STOP=1 -f deploy/sql/bootstrap.sql
--
-- (`terraform output -raw database_bootstrap_command` prints it with the real names.) The three
-- users are the IAM database users Terraform creates (cloudsql.tf); IAM users start with no
-- privileges at all. This gives:
--   migrator   : owns the schema objects the migrations create (CREATE on schema public)
--   dispatcher : member of outbox_dispatcher (DML on pubsub_outbox and the dead-letter table)
--   producer   : member of outbox_producer (INSERT into the outbox; its watermark and run ledger)
-- The table grants to the two group roles are made by the migrations themselves
-- (migrations/20261201000001_workload_roles.sql), by the owner, so they follow the schema.

-- The group roles exist before the first migration, so the migrator needs no CREATEROLE (on
-- PostgreSQL 15 CREATEROLE could grant itself any non-superuser role).
SELECT NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_dispatcher') AS create_dispatcher_role,
       NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'outbox_producer') AS create_producer_role
\gset
\if :create_dispatcher_role
CREATE ROLE outbox_dispatcher NOLOGIN;
\endif
\if :create_producer_role
CREATE ROLE outbox_producer NOLOGIN;
\endif

-- The schema owner. Nothing else: no CREATEROLE, no CREATEDB, no membership in
-- cloudsqlsuperuser.
GRANT USAGE, CREATE ON SCHEMA public TO :"migrator";

-- The group roles reach the tables in schema public (PUBLIC has this by default; spelled out in
-- case a hardened database revoked it).
GRANT USAGE ON SCHEMA public TO outbox_dispatcher, outbox_producer;

-- The workloads log in as themselves and act through their group role.
GRANT outbox_dispatcher TO :"dispatcher";
GRANT outbox_producer TO :"producer";
