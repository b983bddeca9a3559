-- claim_ordered (claim.rs): whole ordering keys, a publishable prefix of each. The steps:
-- heads: a recursive skip-scan over (topic, ordering_key, id) visiting one head per key,
-- evaluated lazily: it stops once `limit` keys are picked. picked: keys whose head is due, not
-- blocked by a dead letter, and not locked by another worker (the head row lock is the key
-- lock; the lateral locks a head only once its key qualifies).
-- $1, $2 the key cursor; $3 keys visited at most; $4 now; $5 topics (NULL: all); $6 topics
-- whose keys skip dead letters; $7 rows at most; $8 keys at most.
WITH RECURSIVE heads(id, topic, ordering_key, due, n) AS (
    (SELECT o.id, o.topic, o.ordering_key, o.next_attempt_at, 1
     FROM pubsub_outbox o
     WHERE o.published_at IS NULL AND o.ordering_key IS NOT NULL
       AND (o.topic, o.ordering_key) > ($1, $2)
     ORDER BY o.topic, o.ordering_key, o.id
     LIMIT 1)
    UNION ALL
    SELECT nx.id, nx.topic, nx.ordering_key, nx.next_attempt_at, h.n + 1
    FROM heads h
    CROSS JOIN LATERAL (
        SELECT o.id, o.topic, o.ordering_key, o.next_attempt_at
        FROM pubsub_outbox o
        WHERE o.published_at IS NULL AND o.ordering_key IS NOT NULL
          AND (o.topic, o.ordering_key) > (h.topic, h.ordering_key)
        ORDER BY o.topic, o.ordering_key, o.id
        LIMIT 1) nx
    WHERE h.n < $3
),
-- A dead letter holds back the rows of its key after its own place (its outbox id;
-- none: all of them), unless its topic skips dead letters: `stop`, the key's first
-- dead-letter position, is where the key's claimable rows end.
stops AS (
    SELECT h.id, h.topic, h.ordering_key, h.n,
           CASE WHEN h.topic = ANY($6) THEN NULL ELSE (
               SELECT min(COALESCE(d.outbox_id, 0)) FROM pubsub_outbox_dead_letter d
               WHERE d.topic = h.topic AND d.ordering_key = h.ordering_key) END AS stop
    FROM heads h
    WHERE h.due <= $4
      AND ($5::text[] IS NULL OR h.topic = ANY($5))
      AND NOT (h.topic = ANY(ARRAY(SELECT p.topic FROM pubsub_outbox_paused_topic p)))
),
picked AS MATERIALIZED (
    SELECT h.id, h.topic, h.ordering_key, h.n, h.stop
    FROM stops h
    CROSS JOIN LATERAL (
        SELECT o.id FROM pubsub_outbox o
        WHERE o.id = h.id AND o.published_at IS NULL AND o.next_attempt_at <= $4
        FOR UPDATE OF o SKIP LOCKED) head
    WHERE h.stop IS NULL OR h.id < h.stop
    LIMIT $8
),
share AS (SELECT GREATEST(1, $7 / GREATEST(1, (SELECT count(*) FROM picked)))::bigint AS per_key),
-- Each picked key's first rows (one more than its share tells whether it has more): a
-- range walk of the key index from the key's head, read without locks (the head's lock
-- is the key's) and cut to the key; then locked by id. Without an equality on the key
-- no other index can give this order (the module doc: plans that cannot collapse).
key_rows AS (
    SELECT r.id FROM picked p
    CROSS JOIN LATERAL (
        SELECT o.id, o.topic, o.ordering_key
        FROM pubsub_outbox o
        WHERE o.published_at IS NULL AND o.ordering_key IS NOT NULL
          AND (o.topic, o.ordering_key, o.id) >= (p.topic, p.ordering_key, p.id)
        ORDER BY o.topic, o.ordering_key, o.id
        LIMIT (SELECT per_key + 1 FROM share)) r
    WHERE r.topic = p.topic AND r.ordering_key = p.ordering_key
      AND (p.stop IS NULL OR r.id < p.stop)
),
claimed AS (
    SELECT o.id, o.topic, o.ordering_key, o.dedupe_key, o.payload, o.attributes,
           o.attempts, o.created_at, o.next_attempt_at
    FROM pubsub_outbox o
    WHERE o.id = ANY(ARRAY(SELECT id FROM key_rows)) AND o.published_at IS NULL
    FOR UPDATE OF o
),
-- Resume after the last key picked when the batch filled up (the walk stopped there);
-- otherwise after the last key visited, or from the start when the walk reached the end.
walk AS (
    SELECT CASE WHEN (SELECT count(*) FROM picked) >= $8
                THEN (SELECT ARRAY[topic, ordering_key] FROM picked ORDER BY n DESC LIMIT 1)
                ELSE (SELECT ARRAY[topic, ordering_key] FROM heads ORDER BY n DESC LIMIT 1) END AS last,
           CASE WHEN (SELECT count(*) FROM picked) >= $8 THEN $3::bigint
                ELSE (SELECT count(*) FROM heads) END AS visited
)
SELECT w.last[1] AS last_topic, w.last[2] AS last_key, w.visited,
       c.id, c.topic, c.ordering_key, c.dedupe_key, c.payload, c.attributes, c.attempts,
       c.created_at, c.next_attempt_at
FROM walk w LEFT JOIN claimed c ON true
ORDER BY c.topic, c.ordering_key, c.id
