-- Anthropic's Message Batches are batches whose requests came inline, not in a file.
ALTER TABLE batches ALTER COLUMN input_file_id DROP NOT NULL;
-- How many of a finished batch's failed lines were cancelled and how many expired (Anthropic's
-- `request_counts` tell them apart); frozen with `completed` and `failed`.
ALTER TABLE batches ADD COLUMN cancelled integer, ADD COLUMN expired integer;
