-- Rows of 0010_provider_batch_endpoint: an ended pack of embeddings.
INSERT INTO provider_batches (id, provider, model, key_name, status, provider_batch_id, lines, bytes,
                              created_at, submitted_at, ended_at, endpoint)
VALUES ('pb_fixture_embeddings', 'oai', 'text-embedding-3-small', 'k1', 'ended', 'batch_fixture_embeddings', 1, 100,
        now(), now(), now(), '/v1/embeddings');
