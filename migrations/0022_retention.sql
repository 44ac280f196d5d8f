-- Retention deletes finished jobs by age without scanning the queue.
CREATE INDEX jobs_finished_at ON jobs (finished_at) WHERE state IN ('succeeded', 'failed', 'cancelled');
