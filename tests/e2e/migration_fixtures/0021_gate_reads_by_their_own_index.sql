-- Rows of 0021_gate_reads_by_their_own_index: an interactive job of acme queued two hours
-- ago (no starvation guard: the starving read passes it by; its queue's head read finds it).
INSERT INTO jobs (id, tenant, class, request, model, deadline, not_before, max_attempts,
                  estimated_input_tokens, estimated_output_tokens, created_at)
VALUES ('0190a000-0000-7000-8000-000000000021', 'acme', 'interactive',
        '{"model": "fast", "messages": [{"role": "user", "content": "asking"}]}', 'fast',
        now() + interval '1 hour', now() - interval '2 hours', 3, 8, 16, now() - interval '2 hours');
