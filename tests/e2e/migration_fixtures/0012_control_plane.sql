-- Rows of 0012_control_plane: a business unit, acme under it with a budget, and a key of
-- acme's (sha256 of "tk-fixture").
INSERT INTO tenants (name, weight, limits, budgets, source)
VALUES ('unit', 1, '{}', '[{"window": "month", "usd": 100}]', 'api');
INSERT INTO tenants (name, weight, parent, limits, budgets, source)
VALUES ('acme', 2, 'unit', '{"rpm": 60}', '[{"window": "day", "usd": 1.5}]', 'file');
INSERT INTO api_keys (id, tenant, name, key_sha256, prefix, source)
VALUES ('0190a000-0000-7000-8000-000000000012', 'acme', 'config',
        decode('2d1c0e2e0b9d1f0a6f0c79f1e3b0b5fbc9b8e7a6d5c4b3a29180716253443526', 'hex'), 'tk-fix', 'file');
-- A provider key added at runtime (its sealed value made up), and the file's k1 disabled.
INSERT INTO provider_keys (provider, name, sealed_value, weight, models)
VALUES ('oai', 'runtime', 'sealed:v1:000000:AAAA', 2, ARRAY['gpt-4o-mini']);
INSERT INTO provider_keys (provider, name, disabled_at) VALUES ('oai', 'k1', now());
