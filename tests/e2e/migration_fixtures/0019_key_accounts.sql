-- Rows of 0019_key_accounts: key `main` of provider `oai` seen serving under org-acme.
INSERT INTO provider_key_accounts (provider, key, account, observed_at)
VALUES ('oai', 'main', 'org-acme', '2026-12-05T00:00:00Z');
