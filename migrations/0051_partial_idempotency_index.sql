-- Most jobs carry no idempotency key, yet every version of every job row put a
-- (tenant, NULL) entry in the unique index that guards the keys — four or five per job
-- over its life. Only rows with a key need the guard.
CREATE UNIQUE INDEX jobs_tenant_idempotency_key_partial ON jobs (tenant, idempotency_key)
    WHERE idempotency_key IS NOT NULL;
ALTER TABLE jobs DROP CONSTRAINT jobs_tenant_idempotency_key;
ALTER INDEX jobs_tenant_idempotency_key_partial RENAME TO jobs_tenant_idempotency_key;
