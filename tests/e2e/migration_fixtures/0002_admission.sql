-- Rows of 0002_admission: a configured bucket, a pending refund, a pause, a learned limit, a calibration.
INSERT INTO buckets (key, scope, dimension, rule, capacity, window_secs, level, updated_at, configured_capacity)
VALUES ('provider:oai:gpt-4o-mini:rpm', 'provider:oai:gpt-4o-mini', 'requests', 'rolling', 100, 60, 99, now(), 100);
INSERT INTO pending_refunds (bucket, amount) SELECT id, 1 FROM buckets WHERE key = 'provider:oai:gpt-4o-mini:rpm';
INSERT INTO pauses (scope, until, reason, created_at)
VALUES ('provider:oai:gpt-4o-mini', now() - interval '1 minute', 'rate_limited', now());
INSERT INTO learned_limits (scope, name, reported, remaining, observed_at, source)
VALUES ('provider:oai:gpt-4o-mini', 'tpm', 200000, 150000, now(), 'headers');
INSERT INTO estimate_calibration (model, input_ratio, output_p90, samples, updated_at)
VALUES ('oai/gpt-4o-mini', 1.1, 80, 25, now());
