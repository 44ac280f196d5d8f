-- Ramp buckets cap how fast the admitted rate may grow: each window allows what the last
-- one used plus `ramp_step`. For them `capacity` is the current window's allowance.
ALTER TABLE buckets ADD COLUMN ramp_step double precision;
ALTER TABLE buckets DROP CONSTRAINT buckets_rule;
ALTER TABLE buckets ADD CONSTRAINT buckets_rule CHECK (rule IN ('rolling', 'fixed', 'gauge', 'ramp'));
