-- Webhooks: endpoints (a tenant's, from the config, or one batch's) and the durable
-- outbox of deliveries, retried until delivered or out of attempts.

CREATE TABLE webhook_endpoints (
    id          bigint GENERATED ALWAYS AS IDENTITY,
    tenant      text        NOT NULL,
    -- NULL: the tenant's endpoint from the config (its jobs and batches); else this batch's.
    batch_id    text,
    url         text        NOT NULL,
    -- `whsec_` + base64: the receiver verifies signatures with it.
    secret      text        NOT NULL,
    events      text[]      NOT NULL,
    -- Set when the receiver answered 410 Gone: nothing more is sent there.
    disabled_at timestamptz,
    created_at  timestamptz NOT NULL,
    CONSTRAINT webhook_endpoints_pkey PRIMARY KEY (id)
);
CREATE UNIQUE INDEX webhook_endpoints_tenant_url ON webhook_endpoints (tenant, url) WHERE batch_id IS NULL;
CREATE INDEX webhook_endpoints_tenant ON webhook_endpoints (tenant);

CREATE TABLE webhook_deliveries (
    -- The `webhook-id` header: constant across retries, the receiver's idempotency key.
    id              text        NOT NULL,
    endpoint_id     bigint      NOT NULL,
    event_type      text        NOT NULL,
    -- The exact bytes sent (and signed), so every retry sends the same body.
    body            text        NOT NULL,
    state           text        NOT NULL DEFAULT 'pending',
    attempts        integer     NOT NULL DEFAULT 0,
    -- Pending: when the next attempt is due. While an attempt is in flight it is pushed
    -- ahead by the sender's lease, so a sender that dies has its delivery retried.
    next_attempt_at timestamptz NOT NULL,
    last_status     integer,
    last_error      text,
    created_at      timestamptz NOT NULL,
    delivered_at    timestamptz,
    CONSTRAINT webhook_deliveries_pkey PRIMARY KEY (id),
    CONSTRAINT webhook_deliveries_endpoint FOREIGN KEY (endpoint_id) REFERENCES webhook_endpoints (id) ON DELETE CASCADE,
    CONSTRAINT webhook_deliveries_state CHECK (state IN ('pending', 'delivered', 'failed'))
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_attempt_at) WHERE state = 'pending';
CREATE INDEX webhook_deliveries_endpoint ON webhook_deliveries (endpoint_id);
CREATE INDEX webhook_deliveries_created_at ON webhook_deliveries (created_at) WHERE state <> 'pending';

-- job.completed / job.failed go into the outbox in the very transaction that ends the
-- job, whichever code path ends it (a dispatcher's write-back, deadline expiry, a rescued
-- lease out of attempts): a trigger, so no path can forget it. A row trigger whose WHEN
-- clause is checked without calling anything: only rows that just ended cost a call,
-- and the call returns after one probe of the endpoint index when the job's tenant has
-- no endpoint. (A statement trigger would need transition tables, which PostgreSQL fills
-- with both versions of every row of every UPDATE of `jobs`.)
CREATE FUNCTION webhook_job_ended() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    event text;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM webhook_endpoints e WHERE e.tenant = NEW.tenant AND e.disabled_at IS NULL) THEN
        RETURN NULL;
    END IF;
    event := CASE WHEN NEW.state = 'succeeded' THEN 'job.completed' ELSE 'job.failed' END;
    INSERT INTO webhook_deliveries (id, endpoint_id, event_type, body, next_attempt_at, created_at)
    SELECT 'msg_' || replace(gen_random_uuid()::text, '-', ''), e.id, event,
           jsonb_build_object(
               'type', event,
               'timestamp', to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
               'data', jsonb_build_object(
                   'id', NEW.id, 'object', 'job', 'state', NEW.state,
                   'batch_id', NEW.batch_id, 'custom_id', NEW.custom_id,
                   'error', CASE WHEN NEW.state = 'succeeded' OR NEW.error_code IS NULL THEN NULL
                                 ELSE jsonb_build_object('code', NEW.error_code, 'message', NEW.error_message) END))::text,
           now(), now()
    FROM webhook_endpoints e
    WHERE e.tenant = NEW.tenant AND (e.batch_id IS NULL OR e.batch_id = NEW.batch_id)
      AND e.disabled_at IS NULL AND event = ANY (e.events);
    RETURN NULL;
END $$;

CREATE TRIGGER jobs_webhook_ended AFTER UPDATE OF state ON jobs FOR EACH ROW
    WHEN (NEW.state IN ('succeeded', 'failed') AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION webhook_job_ended();
