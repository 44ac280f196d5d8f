-- Every process that answers synchronous callers beats here, as its dispatcher extends
-- its leases (`owner` is the dispatcher's lease owner, the value jobs name as their
-- `caller_process`; `expires_at` one lease after the beat). A process whose beat has
-- expired died or lost the database with its callers' connections: the rescue fails the
-- queued and admitted jobs those callers waited for (`client_disconnected`, an admitted
-- one's reservation given back) instead of running them later for nobody. A row is kept a
-- day after its last beat.
CREATE TABLE processes (
    owner      text        PRIMARY KEY,
    expires_at timestamptz NOT NULL
);

-- The rescue's read of a dead process's waiting callers; a synchronous call started on
-- arrival (running) is not in it.
CREATE INDEX jobs_waiting_callers ON jobs (caller_process)
    WHERE caller_process IS NOT NULL AND state IN ('queued', 'admitted');
