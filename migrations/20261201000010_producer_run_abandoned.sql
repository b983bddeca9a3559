-- A run whose execution died (SIGKILL, a lost node) left its producer_run row 'running' forever.
-- The next execution that takes the stream's lock knows nobody else runs the stream and closes
-- such rows as 'abandoned', with finished_at and the reason in error.
ALTER TABLE producer_run DROP CONSTRAINT producer_run_outcome_check;
ALTER TABLE producer_run ADD CONSTRAINT producer_run_outcome_check
    CHECK (outcome IN ('running', 'succeeded', 'failed', 'skipped', 'abandoned'));
