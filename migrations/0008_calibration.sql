-- Estimates learned from reconciled usage, per model: how the provider's input count
-- compares with tollgate's estimate, and how much output the model really produces.
CREATE TABLE estimate_calibration (
    model          text             NOT NULL,
    -- actual input tokens / estimated input tokens, moved at most 0.1 per pass, in [0.5, 2].
    input_ratio    double precision NOT NULL,
    -- 90th percentile of output tokens in the last window.
    output_p90     double precision,
    samples        bigint           NOT NULL,
    updated_at     timestamptz      NOT NULL,
    CONSTRAINT estimate_calibration_pkey PRIMARY KEY (model)
);

CREATE INDEX job_attempts_finished_at ON job_attempts (finished_at);
