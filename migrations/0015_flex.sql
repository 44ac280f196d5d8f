-- The flex lane: a job sent online at the provider's flex tier (OpenAI's and Groq's
-- `service_tier: "flex"`), cheaper and slower, that may be refused for capacity.
ALTER TABLE jobs DROP CONSTRAINT jobs_dispatch_via;
ALTER TABLE jobs ADD CONSTRAINT jobs_dispatch_via CHECK (dispatch_via IN ('online', 'provider_batch', 'flex'));
