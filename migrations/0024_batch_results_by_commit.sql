-- A batch's finished lines by the transaction that ended them (`GET /v1/batches/{id}/results`),
-- without a pass that numbers them afterwards: the transaction that ends a line writes its
-- id (`result_xid`, a trigger, so no path that ends a line can forget it), and a reader
-- reads on from its cursor (`result_xid`, `id`) only below its snapshot's xmin — every
-- transaction with a smaller id has ended, so nothing can later commit behind the cursor.
-- Lines end once: a batch's lines are never queued again.
ALTER TABLE jobs ADD COLUMN result_xid xid8;

CREATE FUNCTION batch_line_ended() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.result_xid := pg_current_xact_id();
    RETURN NEW;
END $$;

CREATE TRIGGER jobs_batch_line_ended BEFORE UPDATE OF state ON jobs FOR EACH ROW
    WHEN (NEW.batch_id IS NOT NULL AND NEW.state IN ('succeeded', 'failed', 'cancelled')
          AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION batch_line_ended();

-- Lines that ended before: this migration's transaction id (it has ended once a reader
-- runs), so they come first, by id. A cursor given out before reads from the start again.
UPDATE jobs SET result_xid = pg_current_xact_id()
WHERE batch_id IS NOT NULL AND state IN ('succeeded', 'failed', 'cancelled');

DROP INDEX jobs_batch_results;
DROP INDEX jobs_batch_unpublished;
ALTER TABLE jobs DROP COLUMN result_seq;
DROP SEQUENCE job_result_seq;
CREATE INDEX jobs_batch_results ON jobs (batch_id, result_xid, id) WHERE result_xid IS NOT NULL;
