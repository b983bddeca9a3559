-- claim_ordered (claim/ordered.rs): whole ordering keys, a publishable prefix of each, filling
-- the batch key by key (a key with a backlog goes out in full requests). The steps:
-- floor, old: where this replica knows the live keyed rows start ($13: every live row with a
-- lower id belongs to one of the old keys, $9, $10, $11: each with the head it last had), so the
-- walk passes over the index entries below the floor without fetching their rows (an index
-- filter; under a long-held snapshot the entries of published rows cannot be retired, and
-- fetching each made a claim cost seconds) and looks for an old key's head from the last one.
-- A replay puts a row back below its key's head: it advances the claim epoch in its own
-- transaction, and knowledge of another epoch than $12 is not used (floor 0, no old keys).
-- heads: the walk from the cursor, one step per key, lazily, at most $3 steps: the next key with
-- a row above the floor, unless the next old key comes first or is that key: then the old key
-- from its last head (no row: it has none left). picked: keys whose head is due, not blocked by
-- a dead letter, and not locked by another worker (the head row lock is the key lock; the
-- lateral locks a head only once its key qualifies).
-- $1, $2 the key cursor; $3 keys visited at most; $4 now; $5 topics (NULL: all); $6 topics
-- whose keys skip dead letters; $7 rows at most; $8 keys picked at most (0: a walk that takes
-- none);
-- $9, $10, $11 the old keys' topics, ordering keys and last heads; $12 the epoch they were seen
-- in; $13 the floor; $14 topics this replica leaves alone now (held, or slowed down by quota).
WITH RECURSIVE
epoch AS MATERIALIZED (SELECT e.epoch FROM pubsub_outbox_claim_epoch e),
valid AS MATERIALIZED (SELECT (SELECT epoch FROM epoch) = $12 AS ok),
floor AS MATERIALIZED (SELECT CASE WHEN (SELECT ok FROM valid) THEN $13::bigint ELSE 0 END AS id),
-- The old keys after the cursor, put in the index's order (its collation's, which the
-- caller's need not be).
old AS MATERIALIZED (
    SELECT coalesce(array_agg(u.topic ORDER BY u.topic, u.ordering_key), '{}') AS topics,
           coalesce(array_agg(u.ordering_key ORDER BY u.topic, u.ordering_key), '{}') AS keys,
           coalesce(array_agg(u.head ORDER BY u.topic, u.ordering_key), '{}') AS heads,
           count(*) AS n
    FROM unnest($9::text[], $10::text[], $11::bigint[]) AS u(topic, ordering_key, head)
    WHERE (SELECT ok FROM valid) AND (u.topic, u.ordering_key) > ($1::text, $2::text)
),
heads(id, topic, ordering_key, due, n, i) AS (
    SELECT NULL::bigint, $1::text, $2::text, NULL::timestamptz, 0, 1
    UNION ALL
    SELECT s.id, s.topic, s.ordering_key, s.due, h.n + 1, s.i
    FROM heads h
    CROSS JOIN LATERAL (
        SELECT (SELECT topics FROM old)[h.i] AS topic, (SELECT keys FROM old)[h.i] AS ordering_key,
               (SELECT heads FROM old)[h.i] AS head, h.i <= (SELECT n FROM old) AS present
    ) ok
    -- The next key with a row above the floor (the entries below it are passed over in the
    -- index: `id >= floor` is checked on each index entry before its row is fetched).
    LEFT JOIN LATERAL (
        SELECT o.id, o.topic, o.ordering_key, o.next_attempt_at AS due
        FROM pubsub_outbox o
        WHERE o.published_at IS NULL AND o.ordering_key IS NOT NULL
          AND (o.topic, o.ordering_key) > (h.topic, h.ordering_key)
          AND o.id >= (SELECT id FROM floor)
        ORDER BY o.topic, o.ordering_key, o.id
        LIMIT 1) nx ON true
    CROSS JOIN LATERAL (
        -- The next old key when it comes first (or is that key): from its last head to the key's
        -- end (see key_rows for the shape of the bounds).
        (SELECT k.id, ok.topic, ok.ordering_key, k.due, h.i + 1 AS i
         FROM (SELECT 1) one
         LEFT JOIN LATERAL (
             SELECT o.id, o.next_attempt_at AS due
             FROM pubsub_outbox o
             WHERE o.published_at IS NULL AND o.ordering_key IS NOT NULL
               AND o.topic = ok.topic
               AND (o.ordering_key, o.id) >= (ok.ordering_key, ok.head)
               AND o.ordering_key <= ok.ordering_key
             ORDER BY o.topic, o.ordering_key, o.id
             LIMIT 1) k ON true
         WHERE ok.present
           AND (nx.id IS NULL OR (nx.topic, nx.ordering_key) >= (ok.topic, ok.ordering_key)))
        UNION ALL
        (SELECT nx.id, nx.topic, nx.ordering_key, nx.due, h.i WHERE nx.id IS NOT NULL)
        LIMIT 1) s
    WHERE h.n < $3
),
visited AS (SELECT * FROM heads WHERE n > 0),
-- A dead letter holds back the rows of its key after its own place (its outbox id;
-- none: all of them), unless its topic skips dead letters or an operator cancelled it (a
-- person's decision: the key goes on): `stop`, the key's first blocking position, is where
-- the key's claimable rows end.
stops AS (
    SELECT h.id, h.topic, h.ordering_key, h.n,
           CASE WHEN h.topic = ANY($6) THEN NULL ELSE (
               SELECT min(COALESCE(d.outbox_id, 0)) FROM pubsub_outbox_dead_letter d
               WHERE d.topic = h.topic AND d.ordering_key = h.ordering_key
                 AND d.error_kind <> 'cancelled') END AS stop
    FROM visited h
    WHERE h.id IS NOT NULL AND h.due <= $4
      AND ($5::text[] IS NULL OR h.topic = ANY($5))
      AND NOT (h.topic = ANY(ARRAY(SELECT p.topic FROM pubsub_outbox_paused_topic p)))
      AND NOT (h.topic = ANY($14))
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
-- The picked keys in walk order (their heads and blocking positions: ids, so each step of the
-- fill reads its key's entry in constant time; the key itself is read from its head row).
taken AS MATERIALIZED (
    SELECT coalesce(array_agg(p.id ORDER BY p.n), '{}') AS heads,
           coalesce(array_agg(p.stop ORDER BY p.n), '{}') AS stops,
           count(*) AS k
    FROM picked p
),
-- The fill: the picked keys in walk order, each giving the room left ($7 rows in all) as many
-- of its rows as it has, from its head in id order, up to its first blocking position; the
-- fill ends when the room does (the keys after that stay picked, their heads locked, and give
-- nothing: the caller picks about as many keys as the last claims filled). Each step fetches
-- one row more than the room (`more`: the key was cut). The rows are read without locks (the
-- head's lock is the key's), then locked by id. A range walk of the key index from the key's
-- head to the key's end: the topic's equality and `ordering_key <= key` end the scan with the
-- key (a walk ended only by its LIMIT ran on into the next keys' entries when a key had fewer
-- rows, fetching every published row there under a held snapshot). Not an equality on the key:
-- with one, the order reduces to id and the primary key offers it, which the planner took on
-- stale statistics, walking every row; the row comparison `(ordering_key, id) >= (key, head)`
-- gives the start.
fill(i, room, ids, more) AS (
    SELECT 0, $7::bigint, '{}'::bigint[], false
    UNION ALL
    SELECT f.i + 1, f.room - least(cardinality(r.ids), f.room), r.ids[1:f.room::int],
           cardinality(r.ids) > f.room
    FROM fill f
    CROSS JOIN LATERAL (
        SELECT (SELECT heads FROM taken)[f.i + 1] AS head,
               coalesce((SELECT stops FROM taken)[f.i + 1], 9223372036854775807) AS stop) t
    CROSS JOIN LATERAL (
        SELECT h.topic, h.ordering_key FROM pubsub_outbox h WHERE h.id = t.head) k
    CROSS JOIN LATERAL (
        SELECT ARRAY(
            SELECT o.id
            FROM pubsub_outbox o
            WHERE o.published_at IS NULL AND o.ordering_key IS NOT NULL
              AND o.topic = k.topic
              AND (o.ordering_key, o.id) >= (k.ordering_key, t.head)
              AND o.ordering_key <= k.ordering_key
              AND o.id < t.stop
            ORDER BY o.topic, o.ordering_key, o.id
            LIMIT f.room + 1) AS ids
        -- Evaluated once (OFFSET 0 keeps the subquery from being pulled up into the three
        -- expressions that read its array, each of which would walk the key again).
        OFFSET 0) r
    WHERE f.i < (SELECT k FROM taken) AND f.room > 0
),
key_rows AS (SELECT unnest(f.ids) AS id FROM fill f WHERE f.i > 0),
claimed AS (
    SELECT o.id, o.topic, o.ordering_key, o.dedupe_key, o.payload, o.attributes,
           o.traceparent, o.tracestate, o.attempts, o.created_at, o.next_attempt_at
    FROM pubsub_outbox o
    WHERE o.id = ANY(ARRAY(SELECT id FROM key_rows)) AND o.published_at IS NULL
    FOR UPDATE OF o
),
-- Where the next claim resumes: after the last key that got rows when the room ran out (the
-- keys picked after it give nothing and are walked again next), after the last key picked when
-- the keys ran out, otherwise after the last key visited, or from the start when the walk
-- reached the end. Every key the walk visited is reported with the head seen there (NULL: none
-- left), with the epoch, for the old keys of the next claims; read as far as the walk went (LIMIT, in walk order, so the report
-- does not drive the walk further). A walk that takes no key ($8 = 0) goes to $3 steps or the
-- end. The caller learns from how many keys were picked and whether the rows filled the room.
stopped AS MATERIALIZED (
    SELECT $8 > 0 AND (SELECT min(room) FROM fill) <= 0 AS by_rows,
           $8 > 0 AND (SELECT count(*) FROM picked) >= $8 AS by_keys,
           (SELECT max(i) FROM fill WHERE cardinality(ids) > 0) AS last_used
),
walk AS (
    SELECT CASE WHEN t.by_rows
                THEN (SELECT ARRAY[h.topic, h.ordering_key] FROM pubsub_outbox h
                      WHERE h.id = (SELECT heads FROM taken)[t.last_used])
                WHEN t.by_keys
                THEN (SELECT ARRAY[topic, ordering_key] FROM picked ORDER BY n DESC LIMIT 1)
                ELSE (SELECT ARRAY[topic, ordering_key] FROM visited ORDER BY n DESC LIMIT 1) END AS last,
           CASE WHEN t.by_rows OR t.by_keys THEN $3::bigint
                ELSE (SELECT count(*) FROM visited) END AS visited,
           CASE WHEN t.by_rows OR t.by_keys THEN (SELECT max(n) FROM picked) END AS went,
           (SELECT count(*) FROM picked) AS picked_keys,
           t.by_rows AS filled_rows
    FROM stopped t
),
seen AS (
    SELECT array_agg(v.topic) AS topics, array_agg(v.ordering_key) AS keys, array_agg(v.id) AS heads
    FROM (SELECT topic, ordering_key, id FROM visited LIMIT (SELECT went FROM walk)) v
)
-- One row of the walk's report, then the claimed rows by key, each key in id order.
SELECT w.last[1] AS last_topic, w.last[2] AS last_key, w.visited, w.picked_keys, w.filled_rows,
       s.topics AS seen_topics, s.keys AS seen_keys, s.heads AS seen_heads,
       (SELECT epoch FROM epoch) AS epoch,
       NULL::bigint AS id, NULL::text AS topic, NULL::text AS ordering_key,
       NULL::text AS dedupe_key, NULL::bytea AS payload, NULL::jsonb AS attributes,
       NULL::text AS traceparent, NULL::text AS tracestate, NULL::int AS attempts, NULL::timestamptz AS created_at, NULL::timestamptz AS next_attempt_at
FROM walk w CROSS JOIN seen s
UNION ALL
(SELECT NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,
        c.id, c.topic, c.ordering_key, c.dedupe_key, c.payload, c.attributes, c.traceparent,
        c.tracestate, c.attempts,
        c.created_at, c.next_attempt_at
 FROM claimed c
 ORDER BY c.topic, c.ordering_key, c.id)
