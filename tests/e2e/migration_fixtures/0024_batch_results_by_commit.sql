-- Rows of 0024_batch_results_by_commit: the second line of 0013's batch is cancelled with
-- it (the trigger writes the transaction's id on the line).
INSERT INTO jobs (id, tenant, class, request, model, deadline, not_before, max_attempts,
                  estimated_input_tokens, estimated_output_tokens, created_at, batch_id, custom_id, batch_line)
VALUES ('0190a000-0000-7000-8000-000000000241', 'acme', 'batch',
        '{"model": "fast", "messages": [{"role": "user", "content": "second"}]}', 'fast',
        now() + interval '1 day', now(), 3, 8, 16, now(), 'batch_0190a000000070008000000000000013', 'second', 2);
UPDATE jobs SET state = 'cancelled', finished_at = now(), error_code = 'batch_cancelled',
                error_message = 'the batch was cancelled'
WHERE id = '0190a000-0000-7000-8000-000000000241';
UPDATE batches SET status = 'cancelled', cancelling_at = now(), cancelled_at = now(), completed = 1, cancelled = 1
WHERE id = 'batch_0190a000000070008000000000000013';
