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
