-- Fallback along a route's targets: the targets ("provider/model") that failed this job
-- with an error another target may not have (overload, network, timeout). The gate admits
-- the job on the route's other targets while any is left.
ALTER TABLE jobs ADD COLUMN failed_targets text[];
