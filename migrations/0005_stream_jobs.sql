-- Streaming chat completions are queued and admitted like any job, but the API process
-- that holds the client's connection runs them; dispatchers leave them alone.
ALTER TABLE jobs ADD COLUMN stream boolean NOT NULL DEFAULT false;
