-- Rows of 0022_caller_process: a synchronous call running for the process its caller is
-- connected to, whose lease has run out (the rescue fails it `client_disconnected`).
INSERT INTO jobs (id, tenant, class, request, model, deadline, not_before, max_attempts,
                  estimated_input_tokens, estimated_output_tokens, created_at, state, attempt,
                  lease_owner, lease_expires_at, started_at, caller_process)
VALUES ('0190a000-0000-7000-8000-000000000022', 'acme', 'interactive',
        '{"model": "fast", "messages": [{"role": "user", "content": "waiting"}]}', 'fast',
        now() + interval '1 hour', now(), 3, 8, 16, now(), 'running', 1,
        'api-1', now() - interval '1 minute', now(), 'api-1');
