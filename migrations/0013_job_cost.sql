-- What a job reserved in USD and where its price came from, so a job shows its cost before
-- and after its call; its trace context; and applications' own limits and budgets on a
-- tenant, shared by every key labelled with the application.

-- Micro-USD reserved for its call at admission (its estimate at the configured price),
-- and the price's source: `model` (the provider's price for the model), `provider`
-- (the provider's `"*"` price) or `unpriced`. NULL until admitted.
ALTER TABLE jobs ADD COLUMN reserved_micro_usd double precision;
ALTER TABLE jobs ADD COLUMN price_source text;

-- The W3C traceparent of the job's `job.submit` span, the parent of the spans of its
-- admissions and attempts; NULL when jobs are not traced.
ALTER TABLE jobs ADD COLUMN traceparent text;

-- {"<application>": {"limits": {…}, "budgets": […]}}: each application's limits and
-- budgets within the tenant, reserved with the rest for jobs of its keys.
ALTER TABLE tenants ADD COLUMN applications jsonb NOT NULL DEFAULT '{}';

-- Batch controls. A paused batch's queued jobs are `held`: out of admission (the gate's
-- index leaves them out) until it resumes; jobs in flight go on. A batch's priority is
-- its queued jobs'.
ALTER TABLE batches ADD COLUMN paused_at timestamptz;
ALTER TABLE batches ADD COLUMN priority integer NOT NULL DEFAULT 0;
ALTER TABLE jobs ADD COLUMN held boolean NOT NULL DEFAULT false;
DROP INDEX jobs_gate;
CREATE INDEX jobs_gate ON jobs (class, tenant, priority DESC, deadline, id) WHERE state = 'queued' AND NOT held;

-- A batch's finished lines as they are published, in order (`GET /v1/batches/{id}/results`):
-- maintenance numbers the lines finished since its last pass, one pass at a time, so a
-- reader's cursor never passes a number that a later commit fills in behind it.
CREATE SEQUENCE job_result_seq;
ALTER TABLE jobs ADD COLUMN result_seq bigint;
CREATE INDEX jobs_batch_results ON jobs (batch_id, result_seq) WHERE result_seq IS NOT NULL;
CREATE INDEX jobs_batch_unpublished ON jobs (finished_at, id)
    WHERE batch_id IS NOT NULL AND result_seq IS NULL AND state IN ('succeeded', 'failed', 'cancelled');

-- A batch's caps: at `max_cost_usd` (a bucket on its lines' path, reserved with the rest)
-- its lines that no longer fit fail `batch_cost_cap_reached`; past `max_error_rate` of its
-- finished lines it is stopped.
ALTER TABLE batches ADD COLUMN max_cost_usd double precision;
ALTER TABLE batches ADD COLUMN max_error_rate double precision;
