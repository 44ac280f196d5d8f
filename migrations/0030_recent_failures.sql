-- The dashboard and `/v1/status` show the latest failures with their reason codes: a small
-- partial index (failed jobs only), newest first.
CREATE INDEX jobs_failed_recent ON jobs (finished_at DESC) WHERE state = 'failed';
