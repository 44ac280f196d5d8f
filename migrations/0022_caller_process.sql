-- A synchronous call's job names the process holding the connection its client waits on
-- (its dispatcher's lease owner). When that process dies holding the call, the rescue
-- fails the job (`client_disconnected`) instead of sending it again: nobody is left to
-- answer, and the caller may already have had the first answer. NULL for jobs whose
-- results are fetched later.
ALTER TABLE jobs ADD COLUMN caller_process text;
