-- The provider account (quota pool) a key added at runtime was declared in, for providers
-- whose responses do not name it (a Gemini key's Google Cloud project): keys of different
-- accounts have their limits learned apart from their first call. NULL: not declared.
ALTER TABLE provider_keys ADD COLUMN account text;
