-- A tenant's own reads (`/v1/status`, the dashboard's tenant view) find its rows without
-- passing those of other tenants: its recent failures and its recent provider calls.
-- (Its queued jobs are found through `jobs_gate`, whose second column is the tenant;
-- admitted and running jobs are bounded by the gate's batch and the dispatchers' room.)
CREATE INDEX jobs_tenant_failed_recent ON jobs (tenant, finished_at DESC) WHERE state = 'failed';
CREATE INDEX job_attempts_tenant_finished_at ON job_attempts (tenant, finished_at);
