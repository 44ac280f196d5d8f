-- The gate: buckets (one limit each) and the reservations jobs hold against them.

CREATE TABLE buckets (
    id          bigint GENERATED ALWAYS AS IDENTITY,
    -- Stable name, e.g. 'provider:oai:gpt-4o-mini:tpm' or 'tenant:acme:daily_spend'.
    key         text             NOT NULL,
    scope       text             NOT NULL,
    dimension   text             NOT NULL,
    rule        text             NOT NULL,
    capacity    double precision NOT NULL,
    -- rolling: refill period (capacity per window, continuous); fixed: window length.
    window_secs bigint           NOT NULL,
    -- What can be taken now (as of updated_at); below zero when actual use exceeded the estimate.
    level       double precision NOT NULL,
    updated_at  timestamptz      NOT NULL,
    -- fixed windows: when the level returns to capacity.
    resets_at   timestamptz,
    source      text             NOT NULL DEFAULT 'configured',
    CONSTRAINT buckets_pkey PRIMARY KEY (id),
    CONSTRAINT buckets_key UNIQUE (key),
    CONSTRAINT buckets_rule CHECK (rule IN ('rolling', 'fixed', 'gauge')),
    CONSTRAINT buckets_dimension CHECK (dimension IN
        ('requests', 'input_tokens', 'output_tokens', 'total_tokens', 'concurrency', 'spend_micro_usd')),
    CONSTRAINT buckets_capacity_nonnegative CHECK (capacity >= 0)
);

ALTER TABLE jobs
    ADD COLUMN admitted_at timestamptz,
    -- The reservation: what this job holds in which bucket. NULL = holds nothing.
    ADD COLUMN reserved_buckets bigint[],
    ADD COLUMN reserved_amounts double precision[],
    -- Why a queued job is still waiting (the gate's explanation), or NULL.
    ADD COLUMN admission jsonb;

-- The gate's view: queued work per (class, tenant), best first.
DROP INDEX jobs_claimable;
CREATE INDEX jobs_gate ON jobs (class, tenant, priority DESC, deadline, id) WHERE state = 'queued';
-- The dispatchers' view: admitted work, best first.
CREATE INDEX jobs_admitted ON jobs (class, priority DESC, admitted_at, id) WHERE state = 'admitted';
-- Reservations whose holder may have died after the job ended (cancelled while running).
CREATE INDEX jobs_orphan_reservations ON jobs (lease_expires_at)
    WHERE reserved_buckets IS NOT NULL AND state IN ('succeeded', 'failed', 'cancelled');
