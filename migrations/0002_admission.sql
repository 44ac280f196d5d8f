-- Admission: buckets (one limit each), the settlements waiting to be applied to them,
-- provider pauses, limits learned from providers, and estimates learned from usage.

CREATE TABLE buckets (
    id          bigint GENERATED ALWAYS AS IDENTITY,
    -- Stable name, e.g. 'provider:oai:gpt-4o-mini:tpm' or 'tenant:acme:daily_spend'.
    key         text             NOT NULL,
    scope       text             NOT NULL,
    dimension   text             NOT NULL,
    rule        text             NOT NULL,
    -- Ramp buckets: the current window's allowance.
    capacity    double precision NOT NULL,
    -- rolling: refill period (capacity per window, continuous); fixed: window length.
    window_secs bigint           NOT NULL,
    -- What can be taken now (as of updated_at); below zero when actual use exceeded the estimate.
    level       double precision NOT NULL,
    updated_at  timestamptz      NOT NULL,
    -- fixed windows: when the level returns to capacity.
    resets_at   timestamptz,
    source      text             NOT NULL DEFAULT 'configured',
    -- Ramp buckets cap how fast the admitted rate may grow: each window allows what the
    -- last one used plus this.
    ramp_step   double precision,
    -- What the config says the capacity is, kept apart from `capacity` once a learned
    -- limit lowers (or, where the provider is the authority, replaces) it.
    configured_capacity double precision,
    learned_at  timestamptz,
    CONSTRAINT buckets_pkey PRIMARY KEY (id),
    CONSTRAINT buckets_key UNIQUE (key),
    CONSTRAINT buckets_rule CHECK (rule IN ('rolling', 'fixed', 'gauge', 'ramp')),
    CONSTRAINT buckets_dimension CHECK (dimension IN
        ('requests', 'input_tokens', 'output_tokens', 'total_tokens', 'concurrency', 'spend_micro_usd')),
    CONSTRAINT buckets_capacity_nonnegative CHECK (capacity >= 0)
);

-- Settlements waiting for the gate, summed per bucket by the transaction that ended the
-- jobs (a few rows per completed batch), so that the gate is the only writer of bucket
-- levels and completions never wait on a bucket's row lock. The gate deletes what it
-- applies, in its locked round.
CREATE TABLE pending_refunds (
    id     bigint GENERATED ALWAYS AS IDENTITY,
    bucket bigint           NOT NULL,
    amount double precision NOT NULL,
    CONSTRAINT pending_refunds_pkey PRIMARY KEY (id)
);

-- A provider's 429 pauses the scope it applies to (a provider model, a key) for every
-- process until its Retry-After: the gate admits nothing there before then.
CREATE TABLE pauses (
    scope      text        NOT NULL,
    until      timestamptz NOT NULL,
    reason     text        NOT NULL,
    created_at timestamptz NOT NULL,
    CONSTRAINT pauses_pkey PRIMARY KEY (scope)
);

-- Learned limits: what providers' responses said about their limits (rate-limit headers,
-- 429 bodies) and what their 429s taught where they say nothing. One row per provider
-- scope and limit; completers write the latest reading, the gate applies it to the
-- bucket `<scope>:<name>` (creating it when the config has none) and marks it applied.
CREATE TABLE learned_limits (
    -- A provider model scope, e.g. 'provider:oai:gpt-4o-mini'.
    scope        text             NOT NULL,
    -- rpm, rpd, tpm, itpm, otpm.
    name         text             NOT NULL,
    -- The capacity the provider reported (NULL: it reported none).
    reported     double precision,
    remaining    double precision,
    observed_at  timestamptz      NOT NULL,
    -- Last 429 on this scope that came without limit information (NULL: none).
    throttled_at timestamptz,
    -- 'headers' (the provider said so) or 'throttling' (learned from 429s).
    source       text             NOT NULL,
    -- Learning from 429s: the capacity before the last decrease, how many decreases,
    -- and when the capacity last changed.
    ceiling      double precision,
    decreases    integer          NOT NULL DEFAULT 0,
    changed_at   timestamptz,
    -- The observation time the gate last applied (NULL: never).
    applied_at   timestamptz,
    CONSTRAINT learned_limits_pkey PRIMARY KEY (scope, name),
    CONSTRAINT learned_limits_source CHECK (source IN ('headers', 'throttling'))
);

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
