-- Settlements waiting for the gate, summed per bucket by the transaction that ended the
-- jobs (a few rows per completed batch), instead of two more versions of every job row
-- (one to record its refund, one when the gate took it): fewer dead tuples and index
-- entries on the hottest table. The gate deletes what it applies, in its locked round.
CREATE TABLE pending_refunds (
    id     bigint GENERATED ALWAYS AS IDENTITY,
    bucket bigint           NOT NULL,
    amount double precision NOT NULL,
    CONSTRAINT pending_refunds_pkey PRIMARY KEY (id)
);

INSERT INTO pending_refunds (bucket, amount)
SELECT r.bucket, sum(r.amount)
FROM jobs, unnest(refund_buckets, refund_amounts) AS r(bucket, amount)
WHERE refund_buckets IS NOT NULL
GROUP BY r.bucket;

DROP INDEX jobs_pending_refunds;
ALTER TABLE jobs DROP COLUMN refund_buckets, DROP COLUMN refund_amounts;
