-- Rows of 0007_tenant_reads: a failed job of globex with its attempt.
INSERT INTO jobs (id, tenant, class, state, request, model, deadline, not_before, attempt, max_attempts,
                  estimated_input_tokens, estimated_output_tokens, error_code, error_message,
                  created_at, started_at, finished_at)
VALUES ('0190a000-0000-7000-8000-000000000007', 'globex', 'standard', 'failed',
        '{"model": "fast", "messages": [{"role": "user", "content": "hi"}]}', 'fast',
        now() + interval '1 hour', now(), 1, 1, 10, 100, 'provider_rejected_request', 'bad',
        now(), now(), now());
INSERT INTO job_attempts (job_id, attempt, tenant, provider, provider_model, key_name, status, outcome,
                          estimated_input_tokens, estimated_output_tokens, started_at, finished_at)
VALUES ('0190a000-0000-7000-8000-000000000007', 1, 'globex', 'oai', 'gpt-4o-mini', 'k1', 400, 'failed',
        10, 100, now(), now());
