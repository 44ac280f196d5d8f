-- The control plane: tenants and their API keys live here, changed at runtime through
-- the admin API and seeded from the config file. Every change bumps `control_version`
-- and sends NOTIFY tollgate_control in its transaction, so every process reloads its
-- directory within a second.

CREATE TABLE tenants (
    name        text PRIMARY KEY,
    -- Share of contended capacity relative to other tenants.
    weight      integer NOT NULL DEFAULT 1 CHECK (weight >= 1),
    -- A partner or business unit whose limits and budgets also cover this tenant.
    parent      text REFERENCES tenants (name) ON DELETE RESTRICT,
    -- {"rpm", "tpm", "rpd", "concurrency"}: each optional.
    limits      jsonb NOT NULL DEFAULT '{}',
    -- [{"window": "day" | "week" | "month", "usd"}]
    budgets     jsonb NOT NULL DEFAULT '[]',
    -- What it may keep stored and how fast it may call one API process, where it has
    -- its own: {"max_files", "max_stored_file_bytes", "api_rate_per_sec", "api_burst"}.
    settings    jsonb NOT NULL DEFAULT '{}',
    -- Who wrote it last: the config file (`file`) or the admin API (`api`).
    source      text NOT NULL DEFAULT 'api' CHECK (source IN ('file', 'api')),
    created_at  timestamptz NOT NULL DEFAULT now(),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE api_keys (
    id           uuid PRIMARY KEY,
    tenant       text NOT NULL REFERENCES tenants (name) ON DELETE CASCADE,
    name         text NOT NULL,
    -- Which of the tenant's applications uses it (usage and budgets group by it).
    application  text,
    -- Only the key's SHA-256 is stored; the secret is shown once, when it is created.
    key_sha256   bytea NOT NULL UNIQUE CHECK (length(key_sha256) = 32),
    -- The secret's first characters, to tell keys apart in listings.
    prefix       text NOT NULL,
    source       text NOT NULL DEFAULT 'api' CHECK (source IN ('file', 'api')),
    -- The key's own limits and budgets, on top of its tenant's (as the tenant's columns).
    limits       jsonb NOT NULL DEFAULT '{}',
    budgets      jsonb NOT NULL DEFAULT '[]',
    -- What it may submit: {"models", "endpoints", "classes", "max_priority"}, each optional.
    scopes       jsonb NOT NULL DEFAULT '{}',
    expires_at   timestamptz,
    revoked_at   timestamptz,
    last_used_at timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX api_keys_tenant ON api_keys (tenant, created_at);

-- The key a job was submitted with (NULL before 0012): its limits and budgets are on the
-- job's path, and usage groups by it and its application.
ALTER TABLE jobs ADD COLUMN api_key uuid;
-- The key that created a batch (its lines' jobs carry it).
ALTER TABLE batches ADD COLUMN api_key uuid;

-- One row: the version of the control plane, bumped by every change.
CREATE TABLE control_version (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    version  bigint NOT NULL
);
INSERT INTO control_version (version) VALUES (0);

-- Provider keys added at runtime (sealed with the server's secret key, never in clear), and
-- keys of the config file disabled at runtime (a row without a value).
CREATE TABLE provider_keys (
    provider     text NOT NULL,
    name         text NOT NULL,
    -- `sealed:v1:<key id>:<base64>`; NULL for a key of the config file.
    sealed_value text,
    weight       integer NOT NULL DEFAULT 1 CHECK (weight >= 1),
    -- The models it may serve; NULL: every model of its provider.
    models       text[],
    -- Its own limits (rpm, tpm, itpm, otpm, rpd, concurrency), across models.
    limits       jsonb,
    disabled_at  timestamptz,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (provider, name)
);

-- Budget thresholds announced (`budget.threshold` webhooks): once per budget bucket,
-- window and threshold.
CREATE TABLE budget_alerts (
    bucket_key text NOT NULL,
    resets_at  timestamptz NOT NULL,
    threshold  double precision NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (bucket_key, resets_at, threshold)
);

-- Route aliases added at runtime (the config file's `[[routes]]` are not here: they change
-- in the file).
CREATE TABLE routes (
    alias      text PRIMARY KEY,
    -- `provider/model` targets in order of preference.
    targets    text[] NOT NULL,
    -- The route's own share (rpm, tpm, …) on all jobs sent through it.
    limits     jsonb,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now()
);
