//! The `[batches]`, `[retention]` and `[webhooks]` sections: bulk JSONL limits, how long
//! finished work is kept, and where signed event notifications go.

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use super::{ConfigError, invalid};
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
            concurrency: 16,
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
    ] {
        if v == 0 {
            return Err(invalid(field, "must be at least 1"));
        }
    }
    if !(webhooks.jitter.is_finite() && (0.0..=1.0).contains(&webhooks.jitter)) {
        return Err(invalid("webhooks.jitter", "must be between 0 and 1"));
    }
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
        assert_eq!(c.webhooks.endpoints[0].event_types().len(), 6);
        let e = err(with(&good.replace("acme", "nobody")));
        assert!(e.contains("webhooks.endpoints[0].tenant"), "{e}");
        let e = err(with(&good.replace("whsec_", "")));
        assert!(e.contains("webhooks.endpoints[0]") && e.contains("whsec_"), "{e}");
        let e = err(with(&format!("{good}\nevents = [\"job.exploded\"]")));
        assert!(e.contains("webhooks.endpoints[0].events"), "{e}");
        let e = err(with(&good.replace("https://", "ftp://")));
        assert!(e.contains("webhooks.endpoints[0].url"), "{e}");
    }
}
