-- A provider batch carries the jobs of one endpoint (OpenAI's Batch API takes one per
-- batch). Every pack before this migration carried chat completions.
ALTER TABLE provider_batches ADD COLUMN endpoint text NOT NULL DEFAULT '/v1/chat/completions';
