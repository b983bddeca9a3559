-- The dedupe keys a stream with a lookback enqueued (or dead-lettered) within its lookback
-- window, so rows re-read below the watermark are recognised after the dispatcher has published
-- and deleted their outbox rows. Written in each page's transaction, pruned below
-- (watermark - lookback) at the start of each run. Streams without a lookback write nothing here.
CREATE TABLE producer_lookback_key (
    stream        TEXT   NOT NULL,
    dedupe_key    TEXT   NOT NULL,
    -- The row's cursor timestamp (UNIX microseconds): what the pruning compares.
    cursor_micros BIGINT NOT NULL,
    PRIMARY KEY (stream, dedupe_key)
);

CREATE INDEX producer_lookback_key_prune_idx ON producer_lookback_key (stream, cursor_micros);
