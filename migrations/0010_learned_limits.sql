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

-- What the config says a bucket's capacity is, kept apart from `capacity` once a
-- learned limit lowers (or, where the provider is the authority, replaces) it.
ALTER TABLE buckets ADD COLUMN configured_capacity double precision;
UPDATE buckets SET configured_capacity = capacity WHERE source = 'configured';
ALTER TABLE buckets ADD COLUMN learned_at timestamptz;
