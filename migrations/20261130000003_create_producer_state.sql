-- Producer state: one watermark per stream, advanced in the same transaction as the rows it covers.
-- The cursor is (timestamp in UNIX microseconds, unique tie-breaker as text): rows sharing a timestamp
-- are never lost at a page or run boundary.
CREATE TABLE producer_watermark (
    stream        TEXT        PRIMARY KEY,
    cursor_micros BIGINT      NOT NULL,
    cursor_key    TEXT        NOT NULL,
    updated_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
    -- The run that last advanced it.
    run_id        BIGINT
);

-- One row per producer execution per stream.
CREATE TABLE producer_run (
    id                 BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    stream             TEXT        NOT NULL,
    -- Cloud Run execution id / hostname, for correlating with logs.
    executor           TEXT        NOT NULL DEFAULT '',
    started_at         TIMESTAMPTZ NOT NULL DEFAULT now(),
    finished_at        TIMESTAMPTZ,
    -- The window read: from the stored watermark (exclusive) to the last row enqueued (inclusive).
    window_from_micros BIGINT,
    window_from_key    TEXT,
    window_to_micros   BIGINT,
    window_to_key      TEXT,
    rows_fetched       BIGINT      NOT NULL DEFAULT 0,
    rows_enqueued      BIGINT      NOT NULL DEFAULT 0,
    rows_duplicate     BIGINT      NOT NULL DEFAULT 0,
    rows_rejected      BIGINT      NOT NULL DEFAULT 0,
    bytes_processed    BIGINT,
    outcome            TEXT        NOT NULL DEFAULT 'running'
                       CHECK (outcome IN ('running', 'succeeded', 'failed', 'skipped')),
    error              TEXT
);

CREATE INDEX producer_run_stream_started_idx ON producer_run (stream, started_at DESC);
