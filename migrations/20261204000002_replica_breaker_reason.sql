-- Why a replica's circuit breaker is open (the probe's or publish's error, naming the endpoint),
-- beside breaker_open: `status` and the console say why claims are paused during an outage, not
-- only that they are. NULL while the breaker is closed.
ALTER TABLE pubsub_outbox_replica ADD COLUMN breaker_reason TEXT;
