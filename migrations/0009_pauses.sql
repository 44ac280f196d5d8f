-- A provider's 429 pauses the scope it applies to (a provider model) for every process
-- until its Retry-After: the gate admits nothing there before then.
CREATE TABLE pauses (
    scope      text        NOT NULL,
    until      timestamptz NOT NULL,
    reason     text        NOT NULL,
    created_at timestamptz NOT NULL,
    CONSTRAINT pauses_pkey PRIMARY KEY (scope)
);
