-- What a job cost at the configured prices, in micro-USD: every attempt's charge summed
-- (a provider-batch line at the batch price). NULL until an attempt is charged; jobs
-- before this migration show none.
ALTER TABLE jobs ADD COLUMN spend_micro_usd double precision;
