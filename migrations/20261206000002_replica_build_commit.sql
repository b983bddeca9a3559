-- Each dispatcher's heartbeat names the commit it was built from (`dispatcher --version`) beside
-- its release (`version`), so `status` and the console tell two builds of one pre-release, or a
-- rebuilt image, apart during a rollout. NULL in the rows of a release before 0.2.0, which does
-- not write it: those run unchanged on this schema (their heartbeat names its columns).
ALTER TABLE pubsub_outbox_replica ADD COLUMN IF NOT EXISTS build_commit TEXT;
