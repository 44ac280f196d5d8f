-- The kind of work a job is: the OpenAI API path its request is for. Every job before
-- this migration is a chat completion.
ALTER TABLE jobs ADD COLUMN endpoint text NOT NULL DEFAULT '/v1/chat/completions';
