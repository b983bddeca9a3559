-- The workloads check the schema's version before they claim or enqueue (a rollout ahead of its
-- migration then says "run migrate" and is not ready, instead of failing every statement), and
-- the operators' commands before they act: every group role may read the migration record.
-- pubsub_outbox_migrations is created by `migrate` itself before the first migration, so it exists
-- here, owned by the migrating role.
GRANT SELECT ON pubsub_outbox_migrations TO outbox_dispatcher, outbox_producer, outbox_operator;
