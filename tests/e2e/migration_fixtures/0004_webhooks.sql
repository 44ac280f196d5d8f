-- Rows of 0004_webhooks: acme's endpoint and one delivery waiting for it.
INSERT INTO webhook_endpoints (tenant, url, secret, events, created_at)
VALUES ('acme', 'https://hooks.example/acme', 'whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw',
        '{job.completed,job.failed}', now());
INSERT INTO webhook_deliveries (id, endpoint_id, event_type, body, next_attempt_at, created_at)
SELECT 'msg_fixture', id, 'job.completed', '{"type": "job.completed"}', now() + interval '1 hour', now()
FROM webhook_endpoints WHERE tenant = 'acme';
