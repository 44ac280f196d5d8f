-- Rows of 0025_provider_key_account: a key added at runtime, declared in an account.
INSERT INTO provider_keys (provider, name, sealed_value, weight, account)
VALUES ('oai', 'declared', 'sealed:v1:000000:AAAA', 1, 'proj-a');
