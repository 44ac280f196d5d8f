-- The provider account (quota pool) each provider key's responses named (OpenAI's
-- `openai-organization`, Anthropic's `anthropic-organization-id`), written by dispatchers
-- when it changes. Keys of one account share its limits; a model whose keys name several
-- accounts has each account's limits learned apart.
CREATE TABLE provider_key_accounts (
    provider    text        NOT NULL,
    key         text        NOT NULL,
    account     text        NOT NULL,
    observed_at timestamptz NOT NULL,
    CONSTRAINT provider_key_accounts_pkey PRIMARY KEY (provider, key)
);
