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
-- A running batch whose first line ended and was numbered among its results.
INSERT INTO batches (id, tenant, endpoint, input_file_id, completion_window, status, class, total, rejected,
                     output_expires_secs, created_at, in_progress_at, expires_at)
VALUES ('batch_0190a000000070008000000000000013', 'acme', '/v1/chat/completions',
        'file-0190a000000070008000000000000003', '24h', 'in_progress', 'batch', 2, 0, 2592000, now(), now(),
        now() + interval '1 day');
INSERT INTO jobs (id, tenant, class, state, request, model, deadline, not_before, max_attempts, attempt,
                  estimated_input_tokens, estimated_output_tokens, created_at, finished_at, batch_id, custom_id,
                  batch_line, result, result_seq)
VALUES ('0190a000-0000-7000-8000-000000000131', 'acme', 'batch', 'succeeded',
        '{"model": "fast", "messages": [{"role": "user", "content": "first"}]}', 'fast',
        now() + interval '1 day', now(), 3, 1, 8, 16, now(), now(), 'batch_0190a000000070008000000000000013',
        'first', 1, '{"id": "chatcmpl-first", "object": "chat.completion", "choices": []}',
        nextval('job_result_seq'));
