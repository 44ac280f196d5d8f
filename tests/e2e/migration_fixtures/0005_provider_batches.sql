-- Rows of 0005_provider_batches: a pack submitted to the provider, carrying the queued job.
INSERT INTO provider_batches (id, provider, model, key_name, status, provider_batch_id, lines, bytes,
                              created_at, submitted_at, next_poll_at)
VALUES ('pb_fixture', 'oai', 'gpt-4o-mini', 'k1', 'in_progress', 'batch_upstream', 1, 200, now(), now(),
        now() + interval '1 hour');
UPDATE jobs SET dispatch_via = 'provider_batch', dispatch_reason = 'deadline_allows_batch_api', provider_batch_id = 'pb_fixture'
WHERE id = '0190a000-0000-7000-8000-000000000002';
