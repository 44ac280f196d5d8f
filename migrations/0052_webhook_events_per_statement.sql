-- job.completed / job.failed events, written by one trigger per UPDATE statement instead of
-- one per finished row: the completer ends hundreds of jobs per statement, and the row
-- trigger's call per job was 40 % of that statement's time even with no endpoint at all.
-- Same events, same transaction, every code path still covered. (PostgreSQL allows no
-- column list with transition tables, so it runs for every UPDATE of `jobs`; it returns at
-- once when no endpoint is enabled, and otherwise joins only the rows that just ended.)
DROP TRIGGER jobs_webhook_event ON jobs;
DROP FUNCTION webhook_job_event();

CREATE FUNCTION webhook_job_events() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM webhook_endpoints WHERE disabled_at IS NULL) THEN
        RETURN NULL;
    END IF;
    INSERT INTO webhook_deliveries (id, endpoint_id, event_type, body, next_attempt_at, created_at)
    SELECT 'msg_' || replace(gen_random_uuid()::text, '-', ''), e.id, ended.event,
           jsonb_build_object(
               'type', ended.event,
               'timestamp', to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'),
               'data', jsonb_build_object(
                   'id', ended.id, 'object', 'job', 'state', ended.state,
                   'batch_id', ended.batch_id, 'custom_id', ended.custom_id,
                   'error', CASE WHEN ended.state = 'succeeded' OR ended.error_code IS NULL THEN NULL
                                 ELSE jsonb_build_object('code', ended.error_code, 'message', ended.error_message) END))::text,
           now(), now()
    FROM (SELECT n.id, n.tenant, n.state, n.batch_id, n.custom_id, n.error_code, n.error_message,
                 CASE WHEN n.state = 'succeeded' THEN 'job.completed' ELSE 'job.failed' END AS event
          FROM new_rows n JOIN old_rows o ON o.id = n.id
          WHERE n.state IN ('succeeded', 'failed') AND o.state IS DISTINCT FROM n.state) ended
    JOIN webhook_endpoints e
      ON e.tenant = ended.tenant AND (e.batch_id IS NULL OR e.batch_id = ended.batch_id)
     AND e.disabled_at IS NULL AND ended.event = ANY (e.events);
    RETURN NULL;
END $$;

CREATE TRIGGER jobs_webhook_events AFTER UPDATE ON jobs
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION webhook_job_events();
