-- One-time database bootstrap for pubsub-outbox, run by an administrator (Cloud SQL: the built-in
-- `postgres` user, a member of cloudsqlsuperuser) in the outbox database (the application's own
-- database, if the outbox lives beside it) BEFORE the first migration. Idempotent: run it again
-- after adding an operator.
--
--   psql "host=127.0.0.1 port=5432 dbname=outbox user=postgres" -v ON_ERROR_STOP=1 \
--     -v migrator='pubsub-outbox-migrate@PROJECT_ID.iam' \
--     -v dispatcher='pubsub-outbox-dispatcher@PROJECT_ID.iam' \
--     -v producer='pubsub-outbox-producer@PROJECT_ID.iam' \
--     -v operator='oncall@example.com' \
--     -f deploy/sql/bootstrap.sql
--
-- (`terraform output -raw database_bootstrap_command` prints it with the real names.) Every
-- variable is optional: a login that is not named is left alone, so `-v operator=NAME` alone
-- makes one more person (or IAM group) an operator, and no variable at all only creates the group
-- roles (a local database where everything logs in as a superuser). The logins are IAM database
-- users (Terraform creates them: cloudsql.tf); IAM users start with no privileges at all. This
-- gives:
--   migrator   : may create the schema objects the migrations create (CREATE on schema public),
--                and so owns them; no CREATEROLE, no CREATEDB, no cloudsqlsuperuser
--   dispatcher : member of outbox_dispatcher (claims, settles, dead-letters)
--   producer   : member of outbox_producer (inserts into the outbox; its watermark and run ledger)
--   operator   : member of outbox_operator (the operator commands; the audit trail records the
--                login next to the actor it declares)
-- The table grants to the group roles are made by the migrations themselves, by the owner, so
-- they follow the schema.

-- The group roles exist before the first migration: no migration needs CREATEROLE.
\ir roles.sql

-- The group roles reach the tables in schema public (PUBLIC has this by default; spelled out in
-- case a hardened database revoked it).
GRANT USAGE ON SCHEMA public TO outbox_dispatcher, outbox_producer, outbox_operator;

\if :{?migrator}
GRANT USAGE, CREATE ON SCHEMA public TO :"migrator";
\endif
-- The workloads and the people log in as themselves and act through their group role.
\if :{?dispatcher}
GRANT outbox_dispatcher TO :"dispatcher";
\endif
\if :{?producer}
GRANT outbox_producer TO :"producer";
\endif
\if :{?operator}
GRANT outbox_operator TO :"operator";
\endif
