-- Rows of 0013_job_cost: a finished job of acme that reserved 60 micro-USD at its model's
-- price, and acme's chatbot application with a daily budget.
INSERT INTO jobs (id, tenant, class, state, request, model, deadline, not_before, max_attempts, attempt,
                  estimated_input_tokens, estimated_output_tokens, created_at, finished_at, provider,
                  provider_model, usage, spend_micro_usd, reserved_micro_usd, price_source)
VALUES ('0190a000-0000-7000-8000-000000000013', 'acme', 'standard', 'succeeded',
        '{"model": "fast", "messages": [{"role": "user", "content": "hi"}]}', 'fast',
        now() + interval '1 hour', now(), 3, 1, 10, 16, now(), now(), 'oai', 'gpt-4o-mini',
        '{"input_tokens": 100, "output_tokens": 40}', 42, 60, 'model');
UPDATE tenants SET applications = '{"chatbot": {"budgets": [{"window": "day", "usd": 2}]}}'
WHERE name = 'acme';
-- A paused batch.
UPDATE batches SET paused_at = now(), priority = 5 WHERE id = 'batch_0190a000000070008000000000000004';
