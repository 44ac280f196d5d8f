-- Files and batches, compatible with OpenAI's Files and Batch APIs.

-- An uploaded file (purpose 'batch') or a batch's output/error file ('batch_output').
-- The bytes live in file_chunks, so uploads and downloads stream and no value is huge.
CREATE TABLE files (
    id          text        NOT NULL,
    tenant      text        NOT NULL,
    purpose     text        NOT NULL,
    filename    text        NOT NULL,
    bytes       bigint      NOT NULL,
    -- Non-blank lines, counted while the upload streamed in (the JSONL records).
    lines       bigint      NOT NULL,
    created_at  timestamptz NOT NULL,
    -- When retention deletes it; NULL = kept.
    expires_at  timestamptz,
    CONSTRAINT files_pkey PRIMARY KEY (id)
);
-- Tenant listings, newest first (ids embed a UUIDv7, so they sort by creation time).
CREATE INDEX files_tenant_id ON files (tenant, id DESC);
CREATE INDEX files_expires_at ON files (expires_at) WHERE expires_at IS NOT NULL;

-- A file's bytes, in order: chunks of about 1 MiB.
CREATE TABLE file_chunks (
    file_id text    NOT NULL,
    seq     integer NOT NULL,
    data    bytea   NOT NULL,
    CONSTRAINT file_chunks_pkey PRIMARY KEY (file_id, seq),
    CONSTRAINT file_chunks_file FOREIGN KEY (file_id) REFERENCES files (id) ON DELETE CASCADE
);

CREATE TABLE batches (
    id                text        NOT NULL,
    tenant            text        NOT NULL,
    endpoint          text        NOT NULL,
    input_file_id     text        NOT NULL,
    completion_window text        NOT NULL,
    status            text        NOT NULL,
    -- The class of the batch's jobs.
    class             job_class   NOT NULL,
    output_file_id    text,
    error_file_id     text,
    metadata          jsonb,
    -- Batch-level errors, OpenAI's `errors` object (`{object: "list", data: [...]}`).
    errors            jsonb,
    -- Lines of the input file: the jobs plus the lines rejected at ingest.
    total             integer     NOT NULL,
    rejected          integer     NOT NULL,
    -- Frozen when the batch finishes; while it runs, counts come from its jobs.
    completed         integer,
    failed            integer,
    usage             jsonb,
    -- How long the output and error files are kept.
    output_expires_secs bigint    NOT NULL,
    created_at        timestamptz NOT NULL,
    in_progress_at    timestamptz,
    expires_at        timestamptz NOT NULL,
    finalizing_at     timestamptz,
    completed_at      timestamptz,
    failed_at         timestamptz,
    expired_at        timestamptz,
    cancelling_at     timestamptz,
    cancelled_at      timestamptz,
    CONSTRAINT batches_pkey PRIMARY KEY (id),
    CONSTRAINT batches_status CHECK (status IN
        ('validating', 'failed', 'in_progress', 'finalizing', 'completed', 'expired', 'cancelling', 'cancelled'))
);
CREATE INDEX batches_tenant_id ON batches (tenant, id DESC);
-- The finalizer's view: batches that have not finished.
CREATE INDEX batches_open ON batches (expires_at) WHERE status IN ('in_progress', 'finalizing', 'cancelling');
CREATE INDEX batches_finished ON batches (created_at)
    WHERE status IN ('completed', 'failed', 'expired', 'cancelled');

-- Input lines rejected at ingest (bad JSON, missing or duplicate custom_id, ...): they
-- go to the error file with their code.
CREATE TABLE batch_line_errors (
    batch_id  text    NOT NULL,
    line      integer NOT NULL,
    custom_id text,
    code      text    NOT NULL,
    message   text    NOT NULL,
    CONSTRAINT batch_line_errors_pkey PRIMARY KEY (batch_id, line),
    CONSTRAINT batch_line_errors_batch FOREIGN KEY (batch_id) REFERENCES batches (id) ON DELETE CASCADE
);

