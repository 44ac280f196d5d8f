-- Rows of 0001_jobs: a finished job with its attempt, and a queued one.
INSERT INTO jobs (id, tenant, class, state, request, model, idempotency_key, metadata, deadline,
                  not_before, attempt, max_attempts, provider, provider_model, estimated_input_tokens,
                  estimated_output_tokens, usage, result, created_at, started_at, finished_at)
VALUES ('0190a000-0000-7000-8000-000000000001', 'acme', 'standard', 'succeeded',
        '{"model": "fast", "messages": [{"role": "user", "content": "hi"}]}', 'fast', 'order-1',
        '{"k": "v"}', now() + interval '1 hour', now(), 1, 6, 'oai', 'gpt-4o-mini', 10, 100,
        '{"input_tokens": 9, "output_tokens": 12, "cached_tokens": 0}', '{"object": "chat.completion"}',
        now(), now(), now()),
       ('0190a000-0000-7000-8000-000000000002', 'acme', 'batch', 'queued',
        '{"model": "fast", "messages": [{"role": "user", "content": "later"}]}', 'fast', NULL, NULL,
        now() + interval '1 day', now(), 0, 6, NULL, NULL, 10, 100, NULL, NULL, now(), NULL, NULL);

INSERT INTO job_attempts (job_id, attempt, tenant, provider, provider_model, key_name, status, outcome,
                          input_tokens, output_tokens, cached_tokens, estimated_input_tokens,
                          estimated_output_tokens, started_at, finished_at)
VALUES ('0190a000-0000-7000-8000-000000000001', 1, 'acme', 'oai', 'gpt-4o-mini', 'k1', 200, 'succeeded',
        9, 12, 0, 10, 100, now(), now());
