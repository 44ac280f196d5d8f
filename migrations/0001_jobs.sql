-- The durable queue: one row per job, from acceptance to its terminal state.

CREATE TYPE job_state AS ENUM ('queued', 'running', 'succeeded', 'failed', 'cancelled');
CREATE TYPE job_class AS ENUM ('interactive', 'standard', 'background', 'batch');

CREATE TABLE jobs (
    id               uuid        NOT NULL,
    tenant           text        NOT NULL,
    class            job_class   NOT NULL,
    priority         integer     NOT NULL DEFAULT 0,
    state            job_state   NOT NULL DEFAULT 'queued',
    -- The client's OpenAI Chat Completions body, "model" as the client wrote it.
    request          jsonb       NOT NULL,
    -- The model as requested: a route alias or provider/model.
    model            text        NOT NULL,
    idempotency_key  text,
    metadata         jsonb,
    deadline         timestamptz NOT NULL,
    not_before       timestamptz NOT NULL,
    attempt          integer     NOT NULL DEFAULT 0,
    max_attempts     integer     NOT NULL,
    lease_owner      text,
    lease_expires_at timestamptz,
    -- Which provider target served (or is serving) the current attempt.
    provider         text,
    provider_model   text,
    provider_request_id text,
    estimated_input_tokens  integer NOT NULL,
    estimated_output_tokens integer NOT NULL,
    usage            jsonb,
    result           jsonb,
    error_code       text,
    error_message    text,
    created_at       timestamptz NOT NULL,
    started_at       timestamptz,
    finished_at      timestamptz,
    CONSTRAINT jobs_pkey PRIMARY KEY (id),
    CONSTRAINT jobs_tenant_idempotency_key UNIQUE (tenant, idempotency_key),
    CONSTRAINT jobs_attempt_nonnegative CHECK (attempt >= 0),
    CONSTRAINT jobs_running_has_lease CHECK (state <> 'running' OR (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL))
);

-- The hot index: only what waits to be claimed. Finished rows leave it.
CREATE INDEX jobs_claimable ON jobs (priority DESC, not_before, id) WHERE state = 'queued';
-- The rescuer's index: leases that may expire.
CREATE INDEX jobs_running_lease ON jobs (lease_expires_at) WHERE state = 'running';
-- Tenant listings, newest first (ids are UUIDv7, time-ordered).
CREATE INDEX jobs_tenant_id ON jobs (tenant, id DESC);

-- Queue rows churn: vacuum them eagerly so dead tuples do not pile up in the hot index.
ALTER TABLE jobs SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.05, fillfactor = 80);

-- One row per provider call: what was sent where, what came back, what it cost.
CREATE TABLE job_attempts (
    job_id        uuid        NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    attempt       integer     NOT NULL,
    provider      text        NOT NULL,
    provider_model text       NOT NULL,
    key_name      text        NOT NULL,
    status        integer,
    outcome       text        NOT NULL,
    error_code    text,
    provider_request_id text,
    input_tokens  integer,
    output_tokens integer,
    cached_tokens integer,
    estimated_input_tokens  integer NOT NULL,
    estimated_output_tokens integer NOT NULL,
    rate_limit    jsonb,
    started_at    timestamptz NOT NULL,
    finished_at   timestamptz NOT NULL,
    CONSTRAINT job_attempts_pkey PRIMARY KEY (job_id, attempt)
);
