//! Provider keys as the control plane has them now: the config file's keys, less those
//! disabled at runtime, and the keys added through the admin API (their secrets opened
//! from what the database holds sealed). The planner chooses among [`Keyring::serving`];
//! a dispatcher sends with [`Keyring::runtime_secret`] for a key the file does not hold.
//!
//! It also knows which account (quota pool) each key belongs to — the one its config or the
//! admin API declared, else the one its responses named: keys of one account share its
//! limits, and a model whose keys are in several accounts learns each one's limits apart
//! ([`Keyring::pool_account`], [`Keyring::pools`]).

use std::collections::HashMap;

use secrecy::SecretString;

use crate::config::{KeyConfig, ModelLimits, ProviderConfig};

/// One provider key known to the control plane.
#[derive(Debug, Clone)]
pub struct KeyringEntry {
    pub provider: String,
    pub name: String,
    pub weight: u32,
    /// The models it may serve; empty: all of its provider's.
    pub models: Vec<String>,
    pub limits: Option<ModelLimits>,
    pub disabled: bool,
    /// The secret of a key added at runtime; `None` for a key of the config file (its
    /// row only says whether it is disabled), or one whose sealed value did not open.
    pub secret: Option<SecretString>,
    /// Added through the admin API (not a key of the file).
    pub runtime: bool,
    /// The account (quota pool) it was added with (a key added at runtime).
    pub account: Option<String>,
}

impl KeyringEntry {
    fn serves(&self, model: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|m| m == model)
    }

    /// Whether calls may be sent with it: enabled, and (added at runtime) its secret open.
    fn usable(&self) -> bool {
        !self.disabled && (!self.runtime || self.secret.is_some())
    }
}

/// A key the planner may choose: its name and weight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyChoice<'a> {
    pub name: &'a str,
    pub weight: u32,
}

/// The account (quota pool) a provider key's response named (`provider_key_accounts`).
#[derive(Debug, Clone, PartialEq)]
pub struct KeyAccount {
    pub provider: String,
    pub key: String,
    pub account: String,
    pub observed_at: chrono::DateTime<chrono::Utc>,
}

/// The keys of one provider model that share its limits: one provider account (a quota
/// pool), or — while not every key's account is known, or all are in the same — all of them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pool<'a> {
    /// Its keys' account ([`Keyring::account`]); `None`: not every key's is known.
    pub account: Option<&'a str>,
    /// Whether the model's keys are in several pools, so this one's limits are learned
    /// under its own scope ([`Keyring::pool_account`]).
    pub apart: bool,
    pub keys: Vec<&'a str>,
}

/// The provider keys of one moment.
#[derive(Debug, Clone, Default)]
pub struct Keyring {
    entries: Vec<KeyringEntry>,
    /// The account each key's responses named, by (provider, key).
    accounts: HashMap<(String, String), String>,
}

impl Keyring {
    pub fn new(entries: Vec<KeyringEntry>) -> Self {
        Self {
            entries,
            accounts: HashMap::new(),
        }
    }

    /// The keyring with the accounts keys' responses named, as `(provider, key, account)`.
    pub fn with_accounts(mut self, accounts: impl IntoIterator<Item = (String, String, String)>) -> Self {
        self.accounts = accounts
            .into_iter()
            .map(|(provider, key, account)| ((provider, key), account))
            .collect();
        self
    }

    /// The account key `name` of `provider` was last seen serving under.
    pub fn observed_account(&self, provider: &str, name: &str) -> Option<&str> {
        self.accounts
            .get(&(provider.to_owned(), name.to_owned()))
            .map(String::as_str)
    }

    /// The account key `name` of `p` was declared in (the file's `account`, or the one it
    /// was added with at runtime).
    pub fn declared_account<'a>(&'a self, p: &'a ProviderConfig, name: &str) -> Option<&'a str> {
        self.key_says(p, name, |k| k.account.as_deref(), |e| e.account.as_deref())
    }

    /// The account key `name` of `p` is in: the one declared (the operator knows, and a
    /// provider that names none leaves no other way to tell pools apart), else the one its
    /// responses named.
    pub fn account<'a>(&'a self, p: &'a ProviderConfig, name: &str) -> Option<&'a str> {
        self.declared_account(p, name)
            .or_else(|| self.observed_account(&p.name, name))
    }

    /// The pool whose limits a call to `model` with key `name` counts against, when the
    /// model's keys are in several: its account. `None` while they share one (every
    /// serving key in one account, or some key's account not yet known — sharing is the
    /// safe guess: two pools taken for one would let twice its limit through).
    pub fn pool_account<'a>(&'a self, p: &'a ProviderConfig, model: &str, name: &str) -> Option<&'a str> {
        let account = self.account(p, name)?;
        apart(&self.serving_accounts(p, model)).then_some(account)
    }

    /// The account of each key that serves `model` of `p`, in [`Keyring::serving`] order.
    fn serving_accounts<'a>(&'a self, p: &'a ProviderConfig, model: &str) -> Vec<Option<&'a str>> {
        self.serving(p, model)
            .iter()
            .map(|k| self.account(p, k.name))
            .collect()
    }

    /// The pools of the keys that serve `model` of `p`, in the order of their first key.
    pub fn pools<'a>(&'a self, p: &'a ProviderConfig, model: &str) -> Vec<Pool<'a>> {
        let serving = self.serving(p, model);
        let accounts = self.serving_accounts(p, model);
        let apart = apart(&accounts);
        if !apart {
            let account = accounts
                .first()
                .copied()
                .flatten()
                .filter(|a| accounts.iter().all(|b| *b == Some(*a)));
            return vec![Pool {
                account,
                apart,
                keys: serving.iter().map(|k| k.name).collect(),
            }];
        }
        let mut pools: Vec<Pool<'a>> = Vec::new();
        for (k, account) in serving.iter().zip(accounts) {
            match pools.iter_mut().find(|pool| pool.account == account) {
                Some(pool) => pool.keys.push(k.name),
                None => pools.push(Pool {
                    account,
                    apart,
                    keys: vec![k.name],
                }),
            }
        }
        pools
    }

    fn entry(&self, provider: &str, name: &str) -> Option<&KeyringEntry> {
        self.entries
            .iter()
            .find(|e| e.provider == provider && e.name == name)
    }

    /// Whether key `name` of `provider` is disabled at runtime.
    pub fn disabled(&self, provider: &str, name: &str) -> bool {
        self.entry(provider, name).is_some_and(|e| e.disabled)
    }

    /// The keys of `p` that may serve `model` now: the file's not disabled, then those
    /// added at runtime, in name order.
    pub fn serving<'a>(&'a self, p: &'a ProviderConfig, model: &str) -> Vec<KeyChoice<'a>> {
        let file = p
            .keys
            .iter()
            .filter(|k| k.serves(model) && !self.disabled(&p.name, &k.name))
            .map(|k| KeyChoice {
                name: &k.name,
                weight: k.weight.max(1),
            });
        let runtime = self
            .entries
            .iter()
            .filter(|e| e.runtime && e.provider == p.name && e.serves(model) && e.usable())
            .map(|e| KeyChoice {
                name: &e.name,
                weight: e.weight.max(1),
            });
        file.chain(runtime).collect()
    }

    /// The limits of key `name` of `p`: the file's, or those it was added with.
    pub fn limits<'a>(&'a self, p: &'a ProviderConfig, name: &str) -> Option<&'a ModelLimits> {
        self.key_says(p, name, |k| k.limits.as_ref(), |e| e.limits.as_ref())
    }

    /// What key `name` of `p` says of itself: the file's key (`file`), else the one added
    /// at runtime (`runtime`).
    fn key_says<'a, T: ?Sized>(
        &'a self,
        p: &'a ProviderConfig,
        name: &str,
        file: impl FnOnce(&'a KeyConfig) -> Option<&'a T>,
        runtime: impl FnOnce(&'a KeyringEntry) -> Option<&'a T>,
    ) -> Option<&'a T> {
        match p.keys.iter().find(|k| k.name == name) {
            Some(k) => file(k),
            None => self.entry(&p.name, name).filter(|e| e.runtime).and_then(runtime),
        }
    }

    /// The secret of key `name` of `provider` when it was added at runtime and may be used.
    pub fn runtime_secret(&self, provider: &str, name: &str) -> Option<&SecretString> {
        self.entry(provider, name)
            .filter(|e| e.runtime && e.usable())
            .and_then(|e| e.secret.as_ref())
    }

    /// The usable keys added at runtime to `provider` that serve `model`, with their secrets.
    pub fn runtime_keys<'a>(
        &'a self,
        provider: &'a str,
        model: &'a str,
    ) -> impl Iterator<Item = (&'a str, &'a SecretString)> + 'a {
        self.entries
            .iter()
            .filter(move |e| e.runtime && e.provider == provider && e.serves(model) && e.usable())
            .filter_map(|e| Some((e.name.as_str(), e.secret.as_ref()?)))
    }
}

/// Whether keys of these accounts are in several pools: every account known, not all one.
fn apart(accounts: &[Option<&str>]) -> bool {
    accounts.iter().all(Option::is_some) && accounts.windows(2).any(|w| w[0] != w[1])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn config() -> Config {
        let text = "[[providers]]\nname = \"oai\"\nkind = \"openai\"\nbase_url = \"http://127.0.0.1:1/v1\"\n\
                    keys = [{ name = \"k1\", value = \"sk-1\", limits = { rpm = 10 } }, { name = \"k2\", value = \"sk-2\", weight = 3 }]\n\
                    models = [\"m\", \"n\"]\n\
                    [[tenants]]\nname = \"acme\"\napi_key = \"tk-acme\"\n";
        Config::parse(text, "test.toml").unwrap()
    }

    fn entry(name: &str, runtime: bool, disabled: bool, models: &[&str]) -> KeyringEntry {
        KeyringEntry {
            provider: "oai".into(),
            name: name.into(),
            weight: 2,
            models: models.iter().map(|m| (*m).to_owned()).collect(),
            limits: Some(ModelLimits {
                rpm: Some(7),
                ..ModelLimits::default()
            }),
            disabled,
            secret: runtime.then(|| SecretString::from(format!("sk-{name}"))),
            runtime,
            account: None,
        }
    }

    #[test]
    fn the_planner_chooses_among_the_file_s_enabled_keys_and_the_runtime_ones() {
        let config = config();
        let p = &config.providers[0];
        let ring = Keyring::new(vec![
            entry("k1", false, true, &[]),
            entry("r1", true, false, &["m"]),
            entry("r2", true, true, &[]),
        ]);
        let names = |model| {
            ring.serving(p, model)
                .iter()
                .map(|c| (c.name.to_owned(), c.weight))
                .collect::<Vec<_>>()
        };
        assert_eq!(names("m"), [("k2".to_owned(), 3), ("r1".to_owned(), 2)]);
        assert_eq!(names("n"), [("k2".to_owned(), 3)], "r1 serves m only");
        assert!(ring.runtime_secret("oai", "r1").is_some());
        assert!(ring.runtime_secret("oai", "r2").is_none(), "disabled");
        assert!(ring.runtime_secret("oai", "k1").is_none(), "the file's own");
        assert_eq!(ring.limits(p, "k1").and_then(|l| l.rpm), Some(10));
        assert_eq!(ring.limits(p, "r1").and_then(|l| l.rpm), Some(7));
        assert_eq!(
            ring.runtime_keys("oai", "m").map(|(n, _)| n).collect::<Vec<_>>(),
            ["r1"]
        );
        let empty = Keyring::default();
        assert_eq!(empty.serving(p, "m").len(), 2, "without rows, the file's keys");
    }

    #[test]
    fn keys_share_one_pool_until_every_one_names_its_account_and_they_differ() {
        let config = config();
        let p = &config.providers[0];
        let seen = |pairs: &[(&str, &str)]| {
            Keyring::new(Vec::new()).with_accounts(
                pairs
                    .iter()
                    .map(|(k, a)| ("oai".to_owned(), (*k).to_owned(), (*a).to_owned())),
            )
        };
        fn listed<'a>(
            ring: &'a Keyring,
            p: &'a ProviderConfig,
        ) -> Vec<(Option<&'a str>, bool, Vec<&'a str>)> {
            ring.pools(p, "m")
                .into_iter()
                .map(|pool| (pool.account, pool.apart, pool.keys))
                .collect()
        }
        let one = |ring| listed(ring, p);

        let unknown = seen(&[("k1", "org-a")]);
        assert_eq!(
            unknown.pool_account(p, "m", "k1"),
            None,
            "k2's account is not known yet"
        );
        assert_eq!(one(&unknown), [(None, false, vec!["k1", "k2"])]);

        let same = seen(&[("k1", "org-a"), ("k2", "org-a")]);
        assert_eq!(
            same.pool_account(p, "m", "k2"),
            None,
            "one account: the model's own scope"
        );
        assert_eq!(one(&same), [(Some("org-a"), false, vec!["k1", "k2"])]);

        let split = seen(&[("k1", "org-a"), ("k2", "org-b")]);
        assert_eq!(split.pool_account(p, "m", "k1"), Some("org-a"));
        assert_eq!(split.pool_account(p, "m", "k2"), Some("org-b"));
        assert_eq!(
            one(&split),
            [
                (Some("org-a"), true, vec!["k1"]),
                (Some("org-b"), true, vec!["k2"])
            ]
        );
    }

    #[test]
    fn declared_accounts_split_pools_before_any_response_and_stand_over_what_responses_name() {
        let text = "[[providers]]\nname = \"gem\"\nkind = \"gemini\"\nbase_url = \"http://127.0.0.1:1\"\n\
                    keys = [{ name = \"k1\", value = \"g-1\", account = \"proj-a\" }, { name = \"k2\", value = \"g-2\" }]\n\
                    models = [\"m\"]\n\
                    [[tenants]]\nname = \"acme\"\napi_key = \"tk-acme\"\n";
        let config = Config::parse(text, "test.toml").unwrap();
        let p = &config.providers[0];
        let added = |name: &str, account: Option<&str>| KeyringEntry {
            provider: "gem".into(),
            models: Vec::new(),
            limits: None,
            account: account.map(str::to_owned),
            ..entry(name, true, false, &[])
        };
        let undeclared = Keyring::new(vec![added("r1", Some("proj-a"))]);
        assert_eq!(
            undeclared.pool_account(p, "m", "k1"),
            None,
            "k2's account is neither declared nor named: one pool, the safe guess"
        );

        let ring = Keyring::new(vec![added("r1", Some("proj-a")), added("r2", Some("proj-b"))]);
        let declared = ring
            .clone()
            .with_accounts([("gem".to_owned(), "k2".to_owned(), "proj-b".to_owned())]);
        assert_eq!(declared.pool_account(p, "m", "k1"), Some("proj-a"));
        let pools: Vec<_> = declared
            .pools(p, "m")
            .into_iter()
            .map(|pool| (pool.account, pool.apart, pool.keys))
            .collect();
        assert_eq!(
            pools,
            [
                (Some("proj-a"), true, vec!["k1", "r1"]),
                (Some("proj-b"), true, vec!["k2", "r2"])
            ]
        );

        // A response naming another account does not move a key declared in one.
        let named = declared.with_accounts([
            ("gem".to_owned(), "k1".to_owned(), "proj-b".to_owned()),
            ("gem".to_owned(), "k2".to_owned(), "proj-b".to_owned()),
        ]);
        assert_eq!(named.pool_account(p, "m", "k1"), Some("proj-a"));
        assert_eq!(named.observed_account("gem", "k1"), Some("proj-b"));
    }
}
