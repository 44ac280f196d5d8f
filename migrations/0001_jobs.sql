-- The durable queue: one row per job from acceptance to its terminal state, and one row
-- per provider call it made.

CREATE TYPE job_state AS ENUM ('queued', 'admitted', 'running', 'succeeded', 'failed', 'cancelled');
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
    admitted_at      timestamptz,
    -- The reservation: what this job holds in which bucket. NULL = holds nothing.
    reserved_buckets bigint[],
    reserved_amounts double precision[],
    -- Why a queued job is still waiting (the gate's explanation), or NULL.
    admission        jsonb,
    -- Streaming chat completions are queued and admitted like any job, but the API
    -- process that holds the client's connection runs them; dispatchers leave them alone.
    stream           boolean     NOT NULL DEFAULT false,
    -- The provider key a job was admitted for (its per-key buckets hold the reservation).
    provider_key     text,
    -- Fallback along a route's targets: the targets ("provider/model") that failed this
    -- job with an error another target may not have (overload, network, timeout). The
    -- gate admits the job on the route's other targets while any is left.
    failed_targets   text[],
    -- A batch's lines are ordinary jobs that know their batch, custom_id and input line.
    batch_id         text,
    custom_id        text,
    batch_line       integer,
    -- Provider batch APIs as a scheduling choice, decided per job: `online` or
    -- `provider_batch`, and why. NULL = not decided (jobs of other classes, or no provider
    -- has a batch API configured).
    dispatch_via     text,
    dispatch_reason  text,
    -- The provider batch (tollgate's `provider_batches.id`) that carries the job.
    provider_batch_id text,
    -- What the batch price saved over the online price, in micro-USD.
    saved_micro_usd  double precision,
    CONSTRAINT jobs_pkey PRIMARY KEY (id),
    CONSTRAINT jobs_attempt_nonnegative CHECK (attempt >= 0),
    CONSTRAINT jobs_running_has_lease CHECK (state <> 'running' OR (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)),
    CONSTRAINT jobs_dispatch_via CHECK (dispatch_via IN ('online', 'provider_batch'))
);

-- Queue rows churn: vacuum them eagerly so dead tuples do not pile up in the hot indexes.
ALTER TABLE jobs SET (autovacuum_vacuum_scale_factor = 0.02, autovacuum_analyze_scale_factor = 0.05, fillfactor = 80);

-- Idempotency keys are unique per tenant. Most jobs carry none, and only rows with a key
-- need the guard (a full unique index took an entry for every version of every row).
CREATE UNIQUE INDEX jobs_tenant_idempotency_key ON jobs (tenant, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
-- The gate's view: queued work per (class, tenant), best first.
CREATE INDEX jobs_gate ON jobs (class, tenant, priority DESC, deadline, id) WHERE state = 'queued';
-- The dispatchers' view: admitted work, best first.
CREATE INDEX jobs_admitted ON jobs (class, priority DESC, admitted_at, id) WHERE state = 'admitted';
-- The rescuer's index: leases that may expire.
CREATE INDEX jobs_running_lease ON jobs (lease_expires_at) WHERE state = 'running';
-- Reservations whose holder may have died after the job ended (cancelled while running).
CREATE INDEX jobs_orphan_reservations ON jobs (lease_expires_at)
    WHERE reserved_buckets IS NOT NULL AND state IN ('succeeded', 'failed', 'cancelled');
-- The maintenance loop fails waiting jobs whose deadline passed: earliest first.
CREATE INDEX jobs_waiting_deadline ON jobs (deadline) WHERE state IN ('queued', 'admitted');
-- Tenant listings, newest first (ids are UUIDv7, time-ordered).
CREATE INDEX jobs_tenant_id ON jobs (tenant, id DESC);
-- Retention deletes finished jobs by age without scanning the queue.
CREATE INDEX jobs_finished_at ON jobs (finished_at) WHERE state IN ('succeeded', 'failed', 'cancelled');
-- The dashboard and `/v1/status` show the latest failures: failed jobs only, newest first.
CREATE INDEX jobs_failed_recent ON jobs (finished_at DESC) WHERE state = 'failed';
-- custom_id is unique per batch; also the batch's index of its jobs.
CREATE UNIQUE INDEX jobs_batch_custom_id ON jobs (batch_id, custom_id) WHERE batch_id IS NOT NULL;
-- "Has this batch unfinished jobs?" without reading its finished ones.
CREATE INDEX jobs_batch_open ON jobs (batch_id)
    WHERE batch_id IS NOT NULL AND state IN ('queued', 'admitted', 'running');
-- The provider-batch packer's view: admitted provider-batch jobs per (provider, model, key).
CREATE INDEX jobs_provider_batch_admitted ON jobs (provider, provider_model, provider_key, admitted_at, id)
    WHERE state = 'admitted' AND dispatch_via = 'provider_batch';

-- One row per provider call: what was sent where, what came back, what it cost. No
-- foreign key to `jobs`: it would make every recorded attempt lock its job row just
-- before the completer's update of that row. Attempts are written only by the holder of
-- a job's lease (the job exists) and deleted with their job by retention, the only place
-- jobs are deleted.
CREATE TABLE job_attempts (
    job_id        uuid        NOT NULL,
    attempt       integer     NOT NULL,
    -- The job's tenant, so traffic by tenant reads attempts alone.
    tenant        text        NOT NULL,
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
CREATE INDEX job_attempts_finished_at ON job_attempts (finished_at);
