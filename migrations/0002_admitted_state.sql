-- Jobs the gate has admitted (their buckets reserved) wait here for a dispatcher.
-- Alone in its migration: a new enum value cannot be used in the transaction that adds it.
ALTER TYPE job_state ADD VALUE IF NOT EXISTS 'admitted' BEFORE 'running';
