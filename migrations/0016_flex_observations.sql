-- The flex lane chosen from what the tier has done lately: the jobs it served and those it
-- refused for capacity, by the time they started.
CREATE INDEX jobs_flex_started ON jobs (started_at)
    WHERE dispatch_via = 'flex' OR dispatch_reason = 'flex_unavailable_retry_online';
