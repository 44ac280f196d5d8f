-- The provider key a job was admitted for (its per-key buckets hold the reservation).
ALTER TABLE jobs ADD COLUMN provider_key text;
