//! The `[batches]`, `[retention]` and `[webhooks]` sections: bulk JSONL limits, how long
//! finished work is kept, and where signed event notifications go.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use super::{ConfigError, invalid};
use crate::webhook_secrets::{KeyError, SealingKey};
use crate::webhook_signing::{EVENT_TYPES, Secret};

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct BatchesConfig {
    /// Most requests (non-blank lines) in one batch input file; OpenAI's limit is 50,000.
    pub max_lines: u64,
    /// Largest uploaded file, in bytes (OpenAI: 200 MB). Larger uploads get 413.
    pub max_file_bytes: u64,
    /// Largest single input line; a longer line goes to the error file (`line_too_large`)
    /// instead of holding a huge request in memory.
    pub max_line_bytes: usize,
    /// Longest `completion_window` accepted, in seconds (OpenAI's only value is `24h`).
    pub max_completion_window_secs: u64,
    /// Jobs inserted per statement at ingest (`unnest` of arrays).
    pub insert_chunk: usize,
    /// How long uploaded files are kept before retention deletes them (OpenAI: 30 days).
    pub file_expires_secs: u64,
    /// How long output and error files are kept, unless the batch asks otherwise.
    pub output_expires_secs: u64,
}

impl Default for BatchesConfig {
    fn default() -> Self {
        Self {
            max_lines: 50_000,
            max_file_bytes: 200 * 1024 * 1024,
            max_line_bytes: 1024 * 1024,
            max_completion_window_secs: 24 * 3600,
            insert_chunk: 2000,
            file_expires_secs: 30 * 86_400,
            output_expires_secs: 30 * 86_400,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionConfig {
    /// Finished jobs (and finished batches) older than this are deleted by maintenance;
    /// their results stay readable until then. Jobs of a batch that has not finished
    /// are kept whatever their age, so its output file is complete.
    pub finished_secs: u64,
    /// How often the pruning step runs, in seconds.
    pub interval_secs: u64,
    /// Most rows one pruning statement deletes (keeps each transaction short).
    pub chunk: i64,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        Self {
            finished_secs: 30 * 86_400,
            interval_secs: 60,
            chunk: 5000,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WebhooksConfig {
    /// Per-tenant endpoints: every event of the tenant's jobs and batches they subscribe to.
    pub endpoints: Vec<WebhookEndpointConfig>,
    /// Allow URLs that resolve to private, loopback, link-local or metadata addresses.
    /// Off by default: a tenant's URL must not reach inside the broker's network.
    pub allow_private_addresses: bool,
    /// Timeout of one delivery attempt.
    pub timeout_secs: u64,
    /// Delays before each retry after the first attempt (Standard Webhooks' schedule);
    /// each gets up to `jitter` of itself added at random. After the last, the delivery
    /// is marked failed.
    pub retry_schedule_secs: Vec<u64>,
    /// Fraction of a retry delay added at random, so receivers coming back are not hit by
    /// every sender at once.
    pub jitter: f64,
    /// Fallback poll of the sender when nothing wakes it, in milliseconds.
    pub poll_interval_ms: u64,
    /// Deliveries in flight at once in this process.
    pub concurrency: usize,
    /// Deliveries in flight at once to one endpoint, counted over every process: a slow
    /// receiver holds at most this many of the sender's slots.
    pub endpoint_concurrency: usize,
    /// Deliveries in flight at once to one tenant's endpoints (its own and its batches'),
    /// counted over every process, so one tenant's slow receivers leave the other slots
    /// to the other tenants.
    pub tenant_concurrency: usize,
    /// An endpoint whose attempts have all failed for this long (seconds since the first
    /// failure after its last success) and at least `disable_after_failures` times in a
    /// row is disabled: its pending deliveries fail and nothing more is queued for it.
    pub disable_after_secs: u64,
    /// Consecutive failed attempts needed, with `disable_after_secs`, to disable an
    /// endpoint; 0 never disables one for failing (a 410 Gone still does).
    pub disable_after_failures: u32,
    /// Name of the environment variable holding the key that seals webhook secrets in
    /// the database (base64 of 32 bytes). When unset, the key is `secret_key_file`'s.
    pub secret_key_env: Option<String>,
    /// File holding that key (relative to the working directory), created with a random
    /// key, mode 0600, when missing. Every process must hold the same key.
    pub secret_key_file: PathBuf,
    /// The key, once loaded ([`WebhooksConfig::sealing_key`]).
    #[serde(skip)]
    sealing_key: KeyCache,
}

/// The sealing key loaded once and shared by every clone of the configuration, so the
/// API and the sender of a process seal and open with one key even if the file changes.
#[derive(Clone, Default)]
struct KeyCache(Arc<OnceLock<Result<SealingKey, KeyError>>>);

impl std::fmt::Debug for KeyCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0.get() {
            Some(Ok(key)) => write!(f, "{key:?}"),
            Some(Err(_)) => f.write_str("KeyCache(unavailable)"),
            None => f.write_str("KeyCache(not loaded)"),
        }
    }
}

impl WebhooksConfig {
    /// The key that seals webhook secrets: from `secret_key_env`'s variable, else from
    /// `secret_key_file` (created on first use). Loaded once; later calls return it.
    pub fn sealing_key(&self) -> Result<&SealingKey, KeyError> {
        self.sealing_key
            .0
            .get_or_init(|| match &self.secret_key_env {
                Some(var) => key_from_env(var),
                None => SealingKey::load_or_create(&self.secret_key_file),
            })
            .as_ref()
            .map_err(Clone::clone)
    }
}

fn key_from_env(var: &str) -> Result<SealingKey, KeyError> {
    let text = std::env::var(var)
        .map(SecretString::from)
        .map_err(|_| KeyError::EnvUnset(var.to_owned()))?;
    SealingKey::from_base64(text.expose_secret())
}

impl Default for WebhooksConfig {
    fn default() -> Self {
        Self {
            endpoints: Vec::new(),
            allow_private_addresses: false,
            timeout_secs: 15,
            retry_schedule_secs: vec![5, 300, 1800, 7200, 18_000, 36_000, 36_000],
            jitter: 0.1,
            poll_interval_ms: 1000,
            concurrency: 64,
            endpoint_concurrency: 4,
            tenant_concurrency: 16,
            disable_after_secs: 5 * 86_400,
            disable_after_failures: 10,
            secret_key_env: None,
            secret_key_file: PathBuf::from(".tollgate/webhook-secret.key"),
            sealing_key: KeyCache::default(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookEndpointConfig {
    /// The tenant whose events go here.
    pub tenant: String,
    pub url: String,
    /// The signing secret, `whsec_` + base64 (Standard Webhooks).
    pub secret: Option<SecretString>,
    /// Name of the environment variable holding the secret.
    pub secret_env: Option<String>,
    /// Event types sent; empty = all of them.
    #[serde(default)]
    pub events: Vec<String>,
    /// Retire the endpoint: nothing more is queued for it, and what is pending is still
    /// delivered (or fails visibly). An endpoint missing from a config is left as it is,
    /// since another process may run a config that has it.
    #[serde(default)]
    pub retired: bool,
    /// Enable the endpoint again at start if it was disabled (by a 410 Gone, or for
    /// failing `webhooks.disable_after_secs`); remove the line once it receives again.
    #[serde(default)]
    pub reenable: bool,
}

impl WebhookEndpointConfig {
    pub fn resolve_secret(&self) -> Result<SecretString, String> {
        let secret = match (&self.secret, &self.secret_env) {
            (Some(v), None) => v.clone(),
            (None, Some(var)) => std::env::var(var)
                .map(SecretString::from)
                .map_err(|_| format!("environment variable {var} (named by `secret_env`) is not set"))?,
            (Some(_), Some(_)) => return Err("give `secret` or `secret_env`, not both".to_owned()),
            (None, None) => return Err("needs `secret` or `secret_env`".to_owned()),
        };
        Secret::parse(secret.expose_secret()).map_err(|e| e.to_string())?;
        Ok(secret)
    }

    /// The subscribed event types (all when none are named).
    pub fn event_types(&self) -> Vec<String> {
        if self.events.is_empty() {
            EVENT_TYPES.iter().map(|e| (*e).to_owned()).collect()
        } else {
            self.events.clone()
        }
    }
}

/// Checks the three sections; `tenants` are the configured tenant names.
pub(super) fn validate(
    batches: &BatchesConfig,
    retention: &RetentionConfig,
    webhooks: &WebhooksConfig,
    tenants: &[&str],
) -> Result<(), ConfigError> {
    for (field, v) in [
        ("batches.max_lines", batches.max_lines),
        ("batches.max_file_bytes", batches.max_file_bytes),
        ("batches.max_line_bytes", batches.max_line_bytes as u64),
        (
            "batches.max_completion_window_secs",
            batches.max_completion_window_secs,
        ),
        ("batches.insert_chunk", batches.insert_chunk as u64),
        ("retention.interval_secs", retention.interval_secs),
        ("retention.chunk", retention.chunk.max(0) as u64),
        ("webhooks.timeout_secs", webhooks.timeout_secs),
        ("webhooks.concurrency", webhooks.concurrency as u64),
        (
            "webhooks.endpoint_concurrency",
            webhooks.endpoint_concurrency as u64,
        ),
        ("webhooks.tenant_concurrency", webhooks.tenant_concurrency as u64),
    ] {
        if v == 0 {
            return Err(invalid(field, "must be at least 1"));
        }
    }
    if !(webhooks.jitter.is_finite() && (0.0..=1.0).contains(&webhooks.jitter)) {
        return Err(invalid("webhooks.jitter", "must be between 0 and 1"));
    }
    if let Some(var) = &webhooks.secret_key_env {
        key_from_env(var).map_err(|e| invalid("webhooks.secret_key_env", e.to_string()))?;
    }
    let mut seen = std::collections::HashSet::new();
    for (i, e) in webhooks.endpoints.iter().enumerate() {
        let at = |f: &str| format!("webhooks.endpoints[{i}].{f}");
        if !tenants.contains(&e.tenant.as_str()) {
            return Err(invalid(
                at("tenant"),
                format!("{:?} is not a configured tenant", e.tenant),
            ));
        }
        if !(e.url.starts_with("http://") || e.url.starts_with("https://")) {
            return Err(invalid(at("url"), "must start with http:// or https://"));
        }
        if let Some(bad) = e.events.iter().find(|t| !EVENT_TYPES.contains(&t.as_str())) {
            return Err(invalid(
                at("events"),
                format!("unknown event type {bad:?} (known: {})", EVENT_TYPES.join(", ")),
            ));
        }
        e.resolve_secret()
            .map_err(|reason| invalid(format!("webhooks.endpoints[{i}]"), reason))?;
        if !seen.insert((e.tenant.as_str(), e.url.as_str())) {
            return Err(invalid(
                at("url"),
                format!("tenant {:?} has this URL twice", e.tenant),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::Config;

    #[test]
    fn the_example_file_parses_with_these_sections() {
        let c = Config::parse(
            include_str!("../../tollgate.example.toml"),
            "tollgate.example.toml",
        )
        .unwrap();
        assert_eq!(c.batches.max_lines, 50_000);
        assert_eq!(
            c.webhooks.retry_schedule_secs,
            [5, 300, 1800, 7200, 18_000, 36_000, 36_000]
        );
        assert_eq!(c.retention.finished_secs, 30 * 86_400);
    }

    #[test]
    fn webhook_endpoints_are_checked() {
        let base = include_str!("../../tollgate.example.toml");
        let with = |endpoint: &str| format!("{base}\n[[webhooks.endpoints]]\n{endpoint}\n");
        let err = |text: String| Config::parse(&text, "t.toml").unwrap_err().to_string();
        let good = "tenant = \"acme\"\nurl = \"https://h.example/x\"\nsecret = \"whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw\"";
        let c = Config::parse(&with(good), "t.toml").unwrap();
        assert_eq!(
            c.webhooks.endpoints[0].event_types().len(),
            crate::webhook_signing::EVENT_TYPES.len()
        );
        let e = err(with(&good.replace("acme", "nobody")));
        assert!(e.contains("webhooks.endpoints[0].tenant"), "{e}");
        let e = err(with(&good.replace("whsec_", "")));
        assert!(e.contains("webhooks.endpoints[0]") && e.contains("whsec_"), "{e}");
        let e = err(with(&format!("{good}\nevents = [\"job.exploded\"]")));
        assert!(e.contains("webhooks.endpoints[0].events"), "{e}");
        let e = err(with(&good.replace("https://", "ftp://")));
        assert!(e.contains("webhooks.endpoints[0].url"), "{e}");
        let twice = format!("{base}\n[[webhooks.endpoints]]\n{good}\n[[webhooks.endpoints]]\n{good}\n");
        let e = err(twice);
        assert!(
            e.contains("webhooks.endpoints[1].url") && e.contains("twice"),
            "{e}"
        );
        let c = Config::parse(
            &with(&format!("{good}\nretired = true\nreenable = true")),
            "t.toml",
        )
        .unwrap();
        assert!(c.webhooks.endpoints[0].retired && c.webhooks.endpoints[0].reenable);
        assert!(!Config::parse(&with(good), "t.toml").unwrap().webhooks.endpoints[0].retired);
    }

    #[test]
    fn delivery_limits_and_the_sealing_key_source_are_checked() {
        let base = include_str!("../../tollgate.example.toml");
        let c = Config::parse(base, "t.toml").unwrap();
        let w = &c.webhooks;
        assert_eq!(
            (w.concurrency, w.endpoint_concurrency, w.tenant_concurrency),
            (64, 4, 16)
        );
        assert_eq!((w.disable_after_secs, w.disable_after_failures), (432_000, 10));
        let err = |from: &str, to: &str| {
            Config::parse(&base.replace(from, to), "t.toml")
                .unwrap_err()
                .to_string()
        };
        let e = err("endpoint_concurrency = 4 ", "endpoint_concurrency = 0 ");
        assert!(e.contains("webhooks.endpoint_concurrency"), "{e}");
        let e = err("tenant_concurrency = 16 ", "tenant_concurrency = 0 ");
        assert!(e.contains("webhooks.tenant_concurrency"), "{e}");
        let e = err(
            "# secret_key_env = \"TOLLGATE_WEBHOOK_KEY\"",
            "secret_key_env = \"TOLLGATE_TEST_SURELY_UNSET_KEY\"",
        );
        assert!(
            e.contains("webhooks.secret_key_env") && e.contains("TOLLGATE_TEST_SURELY_UNSET_KEY"),
            "{e}"
        );
        let e = err(
            "# secret_key_env = \"TOLLGATE_WEBHOOK_KEY\"",
            "secret_key_env = \"PATH\"",
        );
        assert!(
            e.contains("webhooks.secret_key_env") && e.contains("base64"),
            "{e}"
        );
    }

    #[test]
    fn the_sealing_key_is_loaded_once_and_shared_by_clones() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("key");
        let w = crate::config::WebhooksConfig {
            secret_key_file: path.clone(),
            ..Default::default()
        };
        let clone = w.clone();
        let id = w.sealing_key().unwrap().id().to_owned();
        let material = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(
            clone.sealing_key().unwrap().id(),
            id,
            "the clone has the same key"
        );
        assert!(!path.exists(), "not read (nor made) again");
        let shown = format!("{w:?}");
        assert!(shown.contains(&id) && !shown.contains(material.trim()), "{shown}");

        std::fs::write(dir.path().join("file"), "").unwrap();
        let unwritable = crate::config::WebhooksConfig {
            secret_key_file: dir.path().join("file/key"),
            ..Default::default()
        };
        let e = unwritable.sealing_key().unwrap_err().to_string();
        assert!(e.contains("file/key"), "{e}");
    }
}
