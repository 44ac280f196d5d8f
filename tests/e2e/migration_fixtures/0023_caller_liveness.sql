-- Rows of 0023_caller_liveness: a process whose beat expired, and a synchronous call its
-- caller waited for there, still queued (the rescue fails it `client_disconnected`).
INSERT INTO processes (owner, expires_at) VALUES ('api-2', now() - interval '1 minute');
INSERT INTO jobs (id, tenant, class, request, model, deadline, not_before, max_attempts,
                  estimated_input_tokens, estimated_output_tokens, created_at, state, caller_process)
VALUES ('0190a000-0000-7000-8000-000000000023', 'acme', 'interactive',
        '{"model": "fast", "messages": [{"role": "user", "content": "queued"}]}', 'fast',
        now() + interval '1 hour', now(), 3, 8, 16, now(), 'queued', 'api-2');
