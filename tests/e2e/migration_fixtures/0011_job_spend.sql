-- Rows of 0011_job_spend: a finished job of acme that cost 42 micro-USD.
INSERT INTO jobs (id, tenant, class, state, request, model, deadline, not_before, max_attempts, attempt,
                  estimated_input_tokens, estimated_output_tokens, created_at, finished_at, provider,
                  provider_model, usage, spend_micro_usd)
VALUES ('0190a000-0000-7000-8000-000000000011', 'acme', 'standard', 'succeeded',
        '{"model": "fast", "messages": [{"role": "user", "content": "hi"}]}', 'fast',
        now() + interval '1 hour', now(), 3, 1, 10, 16, now(), now(), 'oai', 'gpt-4o-mini',
        '{"input_tokens": 100, "output_tokens": 40}', 42);
