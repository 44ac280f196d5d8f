-- Rows of 0020_starving_reads: a queued job of acme without a deadline of its own,
-- submitted two hours ago (past its class's starvation guard).
INSERT INTO jobs (id, tenant, class, request, model, deadline, not_before, max_attempts,
                  estimated_input_tokens, estimated_output_tokens, created_at)
VALUES ('0190a000-0000-7000-8000-000000000020', 'acme', 'standard',
        '{"model": "fast", "messages": [{"role": "user", "content": "waiting"}]}', 'fast',
        now() + interval '1 hour', now() - interval '2 hours', 3, 8, 16, now() - interval '2 hours');
