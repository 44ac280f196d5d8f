-- The tenant of each provider call, on its attempt record: the dashboard's traffic by
-- tenant (a window of recent attempts, sampled every few seconds) joined every attempt
-- of the window to its job to find it — at 10,000 jobs/s a quarter of a million probes
-- of the jobs table a minute. Records written before this have none; the traffic query
-- looks theirs up in `jobs`.
ALTER TABLE job_attempts ADD COLUMN tenant text;
