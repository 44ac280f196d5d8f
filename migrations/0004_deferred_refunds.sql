-- Settlements are written to the job row and applied to buckets by the gate, which is
-- then the only writer of bucket levels: completions never wait on a bucket's row lock.
ALTER TABLE jobs
    ADD COLUMN refund_buckets bigint[],
    ADD COLUMN refund_amounts double precision[];

CREATE INDEX jobs_pending_refunds ON jobs (id) WHERE refund_buckets IS NOT NULL;
