-- The dashboard's history: one sample per slot of a few seconds, taken by whichever
-- process comes first — queue depth per tenant/class, and traffic per tenant over the
-- time since the slot before. Kept an hour, in the database so that charts survive
-- restarts and every process shows the same.
CREATE TABLE status_samples (
    at            timestamptz      NOT NULL,
    interval_secs double precision NOT NULL,
    -- {"<tenant>/<class>": queued}
    queued        jsonb            NOT NULL,
    -- {"<tenant>": {"succeeded", "failed", "tokens", "status_429", "status_5xx"}}
    traffic       jsonb            NOT NULL,
    CONSTRAINT status_samples_pkey PRIMARY KEY (at)
);


-- Why a queued job waited, over time: the gate's note with `at` each time what it waits
-- for changed (reason, bucket or scope), the last 20.
ALTER TABLE jobs ADD COLUMN admission_log jsonb;
