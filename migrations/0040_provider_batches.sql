-- Provider batch APIs as a scheduling choice: a `batch`-class job whose deadline allows
-- it may be sent through its provider's own batch API (OpenAI Batch, Anthropic Message
-- Batches) at the batch price, instead of one online call.

-- The decision, per job: `online` or `provider_batch`, and why. NULL = not decided (jobs
-- of other classes, or no provider has a batch API configured).
ALTER TABLE jobs
    ADD COLUMN dispatch_via text,
    ADD COLUMN dispatch_reason text,
    -- The provider batch (tollgate's `provider_batches.id`) that carries the job.
    ADD COLUMN provider_batch_id text,
    -- What the batch price saved over the online price, in micro-USD.
    ADD COLUMN saved_micro_usd double precision,
    ADD CONSTRAINT jobs_dispatch_via CHECK (dispatch_via IN ('online', 'provider_batch'));

-- The packer's view: admitted provider-batch jobs per (provider, model, key).
CREATE INDEX jobs_provider_batch_admitted ON jobs (provider, provider_model, provider_key, admitted_at, id)
    WHERE state = 'admitted' AND dispatch_via = 'provider_batch';

-- One batch submitted to a provider's batch API. Its jobs are `running` with the lease
-- owner `provider_batch:<id>` until its results are written back.
CREATE TABLE provider_batches (
    id                 text        NOT NULL,
    provider           text        NOT NULL,
    model              text        NOT NULL,
    key_name           text,
    -- `submitting` (row and job claims committed, provider not yet told), `in_progress`
    -- (the provider has it: `provider_batch_id` set), `ended` (results written back),
    -- `abandoned` (never submitted: its jobs went back to the queue).
    status             text        NOT NULL,
    provider_batch_id  text,
    input_file_id      text,
    provider_status    text,
    lines              integer     NOT NULL,
    bytes              bigint      NOT NULL,
    succeeded          integer,
    failed             integer,
    requeued           integer,
    -- What the succeeded lines would have cost online, and what they cost at the batch price.
    online_cost_micro_usd double precision,
    batch_cost_micro_usd  double precision,
    error              text,
    created_at         timestamptz NOT NULL,
    submitted_at       timestamptz,
    next_poll_at       timestamptz,
    ended_at           timestamptz,
    CONSTRAINT provider_batches_pkey PRIMARY KEY (id),
    CONSTRAINT provider_batches_status CHECK (status IN ('submitting', 'in_progress', 'ended', 'abandoned'))
);
CREATE INDEX provider_batches_open ON provider_batches (next_poll_at)
    WHERE status IN ('submitting', 'in_progress');
