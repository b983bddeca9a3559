-- The operator commands, one framework for both binaries (issue #21):
-- `dispatcher replicas prune` deletes the heartbeat rows of replicas that are gone, and
-- `producer rewind` reads how far back a lookback stream remembers its enqueued keys, to say
-- truthfully which re-read rows are enqueued again. (outbox_operator exists: 20261201000015
-- refuses to run without it.)
GRANT DELETE ON pubsub_outbox_replica TO outbox_operator;
GRANT SELECT ON producer_lookback_key TO outbox_operator;
