-- Claims start past what is published (issue #26; shared/src/store/claim/mod.rs, "Claims start
-- past what is published"). Under a long-held snapshot the index entries of published rows
-- cannot be retired, and walking them from the queue's start made each claim cost seconds; a
-- dispatcher now keeps a floor below which every live keyed row belongs to a few known keys.
--
-- The claim epoch: a replay puts a row back below its key's head, so it advances the epoch in
-- its own transaction, and a claim that reads another epoch than its floor's does not use the
-- floor. One row.
CREATE TABLE pubsub_outbox_claim_epoch (
    singleton BOOLEAN PRIMARY KEY DEFAULT true CHECK (singleton),
    epoch     BIGINT  NOT NULL
);
INSERT INTO pubsub_outbox_claim_epoch (epoch) VALUES (0);

COMMENT ON TABLE pubsub_outbox_claim_epoch IS
    'Advanced by every replay of a keyed dead letter: dispatchers then drop the claim floor they keep.';

-- The dispatcher reads the epoch, and how far the id sequence has allocated (the floor rises to
-- what it had allocated a margin earlier); an operator's replay advances the epoch.
-- (outbox_dispatcher and outbox_operator exist: 20261201000001 and 20261201000015.)
GRANT SELECT ON pubsub_outbox_claim_epoch TO outbox_dispatcher;
GRANT SELECT, UPDATE ON pubsub_outbox_claim_epoch TO outbox_operator;
GRANT SELECT ON SEQUENCE pubsub_outbox_id_seq TO outbox_dispatcher;
