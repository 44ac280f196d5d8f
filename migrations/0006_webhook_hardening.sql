-- Webhook hardening: a lease per delivery attempt (so in-flight deliveries can be counted
-- per endpoint and per tenant), endpoints disabled for sustained failure with the reason
-- recorded, and endpoints retired by a config without losing what is pending for them.

ALTER TABLE webhook_endpoints
    -- Why `disabled_at` is set: a 410 Gone, or failing for `webhooks.disable_after_secs`.
    ADD COLUMN disabled_reason      text,
    -- Set by a config marking the endpoint `retired`: nothing more is queued for it, what
    -- is pending is still delivered.
    ADD COLUMN retired_at           timestamptz,
    -- The failure streak: the first failed attempt since the last success, and how many
    -- attempts in a row have failed.
    ADD COLUMN failing_since        timestamptz,
    ADD COLUMN consecutive_failures integer NOT NULL DEFAULT 0;

-- Until 0006 only a 410 disabled an endpoint.
UPDATE webhook_endpoints SET disabled_reason = 'the receiver answered 410 Gone'
WHERE disabled_at IS NOT NULL;

-- While an attempt is in flight: when its lease ends (also `next_attempt_at`). Cleared when
-- the attempt's outcome is written; a lease left behind by a sender that died is over by
-- then and counts for nothing.
ALTER TABLE webhook_deliveries ADD COLUMN leased_until timestamptz;

-- An endpoint's due deliveries, oldest first, and the skip scan over the endpoints that
-- have pending ones (the claim).
CREATE INDEX webhook_deliveries_endpoint_due ON webhook_deliveries (endpoint_id, next_attempt_at)
    WHERE state = 'pending';
-- The deliveries in flight, counted per endpoint and per tenant by every claim.
CREATE INDEX webhook_deliveries_leased ON webhook_deliveries (endpoint_id)
    WHERE leased_until IS NOT NULL;

-- Job events go to endpoints neither disabled nor retired.
CREATE OR REPLACE FUNCTION webhook_job_ended() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    event text;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM webhook_endpoints e
                   WHERE e.tenant = NEW.tenant AND e.disabled_at IS NULL AND e.retired_at IS NULL) THEN
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
      AND e.disabled_at IS NULL AND e.retired_at IS NULL AND event = ANY (e.events);
    RETURN NULL;
END $$;
