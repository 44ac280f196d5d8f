-- Each queue's oldest runnable jobs, for the gate's rounds: a round reads each (class,
-- tenant) queue's head in the tenant's order (`jobs_gate`) and, beside it, its jobs past
-- their class's starvation guard, which may stand behind more jobs due sooner than the
-- head it reads.
CREATE INDEX jobs_gate_oldest ON jobs (class, tenant, created_at) WHERE state = 'queued' AND NOT held;
