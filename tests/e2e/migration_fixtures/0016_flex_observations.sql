-- Rows of 0016_flex_observations: beside the fixture job the flex tier served, one it
-- refused, then served online.
INSERT INTO jobs (id, tenant, class, state, request, model, deadline, not_before, attempt, max_attempts,
                  provider, provider_model, estimated_input_tokens, estimated_output_tokens, usage, result,
                  created_at, started_at, finished_at, dispatch_via, dispatch_reason)
VALUES ('0190a000-0000-7000-8000-000000000003', 'acme', 'standard', 'succeeded',
        '{"model": "fast", "messages": [{"role": "user", "content": "hi"}]}', 'fast',
        now() + interval '1 hour', now(), 2, 6, 'oai', 'gpt-4o-mini', 10, 100,
        '{"input_tokens": 9, "output_tokens": 12, "cached_tokens": 0}', '{"object": "chat.completion"}',
        now(), now(), now(), 'online', 'flex_unavailable_retry_online');
