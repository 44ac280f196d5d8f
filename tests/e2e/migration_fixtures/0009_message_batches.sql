-- Rows of 0009_message_batches: an ended Message Batch of acme, its requests inline.
INSERT INTO batches (id, tenant, endpoint, input_file_id, completion_window, status, class, total, rejected,
                     completed, failed, cancelled, expired, output_expires_secs, created_at, in_progress_at,
                     expires_at, completed_at)
VALUES ('msgbatch_0190a000000070008000000000000009', 'acme', '/v1/messages', NULL, '24h', 'completed', 'batch',
        3, 0, 1, 2, 1, 1, 86400, now(), now(), now() + interval '1 day', now());
