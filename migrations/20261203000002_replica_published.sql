-- Each dispatcher's heartbeat carries the messages it has published since it started, so the
-- console (`dispatcher console`) can plot published messages per second from the database alone,
-- without a monitoring stack: the sum of the replicas' increments between two samples.
ALTER TABLE pubsub_outbox_replica ADD COLUMN published BIGINT NOT NULL DEFAULT 0;
