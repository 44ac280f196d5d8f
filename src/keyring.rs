//! Provider keys as the control plane has them now: the config file's keys, less those
//! disabled at runtime, and the keys added through the admin API (their secrets opened
//! from what the database holds sealed). The planner chooses among [`Keyring::serving`];
//! a dispatcher sends with [`Keyring::runtime_secret`] for a key the file does not hold.

use secrecy::SecretString;

use crate::config::{ModelLimits, ProviderConfig};

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

/// The provider keys of one moment.
#[derive(Debug, Clone, Default)]
pub struct Keyring {
    entries: Vec<KeyringEntry>,
}

impl Keyring {
    pub fn new(entries: Vec<KeyringEntry>) -> Self {
        Self { entries }
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
        match p.keys.iter().find(|k| k.name == name) {
            Some(k) => k.limits.as_ref(),
            None => self
                .entry(&p.name, name)
                .filter(|e| e.runtime)
                .and_then(|e| e.limits.as_ref()),
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
}
