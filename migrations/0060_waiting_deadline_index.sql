-- The maintenance loop fails queued and admitted jobs whose deadline passed, every second.
-- No index led with the deadline, so each pass read the whole table (75 ms at 100,000
-- rows, growing with the backlog). Only waiting rows are in this one, earliest first.
CREATE INDEX jobs_waiting_deadline ON jobs (deadline) WHERE state IN ('queued', 'admitted');
