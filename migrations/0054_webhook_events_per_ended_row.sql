-- job.completed / job.failed events from a row trigger that fires only for rows that just
-- ended, instead of the statement trigger of 0052. That one needed transition tables,
-- which PostgreSQL fills with a copy of the old and the new version of every row of every
-- UPDATE of `jobs` (admission, claim, heartbeat...), since a transition table cannot be
-- limited to some columns: 8 % of end-to-end throughput. A row trigger's WHEN clause is
-- checked without calling anything, so only ended rows cost a call, and the call returns
-- after one probe of the endpoint index when the job's tenant has no endpoint.
-- Same events, same transaction, every code path that ends a job still covered.
DROP TRIGGER jobs_webhook_events ON jobs;
DROP FUNCTION webhook_job_events();

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
