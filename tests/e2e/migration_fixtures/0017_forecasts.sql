-- Rows of 0017_forecasts: a finished job forecast at submission.
INSERT INTO jobs (id, tenant, class, state, request, model, deadline, not_before, attempt, max_attempts,
                  provider, provider_model, estimated_input_tokens, estimated_output_tokens, usage, result,
                  created_at, started_at, finished_at, eta_p50, eta_p90)
VALUES ('0190a000-0000-7000-8000-000000000017', 'acme', 'standard', 'succeeded',
        '{"model": "fast", "messages": [{"role": "user", "content": "hi"}]}', 'fast',
        now() + interval '1 hour', now(), 1, 6, 'oai', 'gpt-4o-mini', 10, 100,
        '{"input_tokens": 9, "output_tokens": 12, "cached_tokens": 0}', '{"object": "chat.completion"}',
        now() - interval '10 seconds', now() - interval '9 seconds', now(),
        now() - interval '2 seconds', now() + interval '5 seconds');
