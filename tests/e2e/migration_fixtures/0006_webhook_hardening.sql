-- Rows of 0006_webhook_hardening: globex's endpoint, retired with a delivery still pending
-- and one in flight, and acme's old endpoint, disabled for failing.
INSERT INTO webhook_endpoints (tenant, url, secret, events, created_at, retired_at)
VALUES ('globex', 'https://hooks.example/globex', 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw',
        '{job.completed}', now(), now());
INSERT INTO webhook_endpoints (tenant, url, secret, events, created_at, disabled_at, disabled_reason,
                               failing_since, consecutive_failures)
VALUES ('acme', 'https://hooks.example/acme-old', 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw',
        '{job.completed}', now(), now(), 'failing since then', now() - interval '6 days', 12);
INSERT INTO webhook_deliveries (id, endpoint_id, event_type, body, next_attempt_at, created_at)
SELECT 'msg_fixture_retired', id, 'job.completed', '{"type": "job.completed"}', now() + interval '1 hour', now()
FROM webhook_endpoints WHERE tenant = 'globex';
INSERT INTO webhook_deliveries (id, endpoint_id, event_type, body, attempts, next_attempt_at, leased_until, created_at)
SELECT 'msg_fixture_in_flight', id, 'job.completed', '{"type": "job.completed"}', 1,
       now() + interval '1 minute', now() + interval '1 minute', now()
FROM webhook_endpoints WHERE tenant = 'globex';
