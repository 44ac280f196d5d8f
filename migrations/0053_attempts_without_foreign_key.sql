-- Attempt records without a foreign key to `jobs`. The key made every recorded attempt
-- lock its job row (FOR KEY SHARE: a WAL record per row) just before the completer's
-- update of that same row, in the same transaction. Attempts are written only by the
-- holder of a job's lease (the job exists) and deleted with their job by retention
-- (`prune_finished_jobs`), which is the only place jobs are deleted.
ALTER TABLE job_attempts DROP CONSTRAINT job_attempts_job_id_fkey;
