-- Rows of 0014_console: a sample of the dashboard's history, and an operator's pause of
-- acme's queue.
INSERT INTO status_samples (at, interval_secs, queued, traffic)
VALUES (now() - interval '10 seconds', 2.0, '{"acme/standard": 3}',
        '{"acme": {"succeeded": 4, "failed": 1, "tokens": 500, "status_429": 1, "status_5xx": 0}}');
INSERT INTO pauses (scope, until, reason, created_at)
VALUES ('tenant:acme', '9999-12-31T00:00:00Z', 'operator', now());
