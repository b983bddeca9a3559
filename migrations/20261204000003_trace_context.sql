-- The writer's W3C trace context (www.w3.org/TR/trace-context), carried through the outbox so one
-- trace runs from the writer's transaction to the consumer's handler (docs/tracing.md).
--
-- Columns, not a reserved attribute: the attributes are what the consumer receives, while the
-- context is the relay's to continue (the dispatcher publishes it as `googclient_traceparent`,
-- pointing at its own send span); the dispatcher reads it without parsing each row's JSON; a
-- dead letter and its replay keep it. Both nullable and unchecked: a row without a context costs
-- nothing, and a malformed one is the dispatcher's to ignore (one warning, the message still
-- goes out), never a reason to fail the writer's business transaction. Adding a nullable column
-- is a catalog change: no rewrite, no long lock. The roles' table grants cover the new columns.
ALTER TABLE pubsub_outbox
    ADD COLUMN traceparent TEXT,
    ADD COLUMN tracestate  TEXT;

ALTER TABLE pubsub_outbox_dead_letter
    ADD COLUMN traceparent TEXT,
    ADD COLUMN tracestate  TEXT;

COMMENT ON COLUMN pubsub_outbox.traceparent IS
    'The writer''s W3C traceparent (00-<trace id>-<span id>-<flags>), or NULL: published as googclient_traceparent.';
COMMENT ON COLUMN pubsub_outbox.tracestate IS
    'The writer''s W3C tracestate, or NULL: published as googclient_tracestate with a valid traceparent.';
