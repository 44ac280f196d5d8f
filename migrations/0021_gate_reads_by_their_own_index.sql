-- The starving read's index leaves out interactive jobs (their class has no starvation
-- guard), so a round's read of a queue's head in the tenant's order cannot be planned on
-- it: with statistics that missed a burst of queued jobs, the planner took it there as
-- just as cheap as `jobs_gate` and sorted every queued job of the queue for each read.
DROP INDEX jobs_gate_oldest;
CREATE INDEX jobs_gate_oldest ON jobs (class, tenant, created_at)
    WHERE state = 'queued' AND NOT held AND class <> 'interactive';

-- The paused batches, read every maintenance pass before their lines are held again.
CREATE INDEX batches_paused ON batches (id)
    WHERE paused_at IS NOT NULL AND status IN ('validating', 'in_progress');
