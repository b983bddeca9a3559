-- Rows the producer rejects keep their place in their key's order (issue #23): each takes an id
-- from the outbox's own sequence, in its page's order, recorded as the dead letter's outbox_id.
-- A dead letter then holds back only the rows of its key after it, and a replay puts it back
-- where it was. (outbox_producer exists: 20261201000001 creates it.)
GRANT USAGE ON SEQUENCE pubsub_outbox_id_seq TO outbox_producer;
