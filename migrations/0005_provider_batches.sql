-- Provider batch APIs as a scheduling choice: a `batch`-class job whose deadline allows
-- it may be sent through its provider's own batch API (OpenAI Batch, Anthropic Message
-- Batches) at the batch price, instead of one online call (`jobs.dispatch_via`).

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
