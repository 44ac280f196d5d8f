-- Rows of 0003_batches: an input file with its bytes, a batch over it with a rejected line,
-- and the queued job of 0001 as its line.
INSERT INTO files (id, tenant, purpose, filename, bytes, lines, created_at)
VALUES ('file-0190a000000070008000000000000003', 'acme', 'batch', 'in.jsonl', 2, 1, now());
INSERT INTO file_chunks (file_id, seq, data) VALUES ('file-0190a000000070008000000000000003', 0, '\x7b7d');
INSERT INTO batches (id, tenant, endpoint, input_file_id, completion_window, status, class, total, rejected,
                     output_expires_secs, created_at, in_progress_at, expires_at)
VALUES ('batch_0190a000000070008000000000000004', 'acme', '/v1/chat/completions',
        'file-0190a000000070008000000000000003', '24h', 'in_progress', 'batch', 2, 1, 2592000, now(), now(),
        now() + interval '1 day');
INSERT INTO batch_line_errors (batch_id, line, custom_id, code, message)
VALUES ('batch_0190a000000070008000000000000004', 2, 'b', 'invalid_json', 'line 2 is not JSON');
UPDATE jobs SET batch_id = 'batch_0190a000000070008000000000000004', custom_id = 'a', batch_line = 1
WHERE id = '0190a000-0000-7000-8000-000000000002';
