-- Rows of 0008_job_endpoint: a queued embeddings job of acme.
INSERT INTO jobs (id, tenant, class, request, model, deadline, not_before, max_attempts,
                  estimated_input_tokens, estimated_output_tokens, created_at, endpoint)
VALUES ('0190a000-0000-7000-8000-000000000008', 'acme', 'standard',
        '{"model": "fast", "input": ["one", "two"]}', 'fast',
        now() + interval '1 hour', now(), 3, 2, 0, now(), '/v1/embeddings');
