//! Configuration of the mock provider: the TOML schema, its documented defaults and
//! its validation. Nothing here runs at request time; [`super::MockProvider::new`] turns
//! a [`MockConfig`] into the runtime state.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Whole mock configuration, usually loaded from TOML.
///
/// ```toml
/// latency_ms = 0                  # base latency per admitted request
/// latency_per_output_token_us = 0 # extra latency per generated token
/// output_tokens = 16              # tokens generated per request, capped by max_tokens
/// send_rate_limit_headers = true  # false = DeepSeek-like: no rate-limit or retry-after headers
///
/// [[projects]]
/// name = "oai-proj"
/// kind = "openai"
/// keys = ["sk-mock-1"]
/// rpm = 600
/// tpm = 100000
///
/// [[faults]]
/// project = "oai-proj"
/// start_ms = 0
/// duration_ms = 20000
/// status = 503
/// probability = 1.0
///
/// [fault_mix]                     # random faults on every model request, by share
/// seed = 7
/// http_503 = 0.02
/// reset = 0.02
/// ```
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct MockConfig {
    /// Base latency added to every admitted request, in milliseconds; a stream spends it
    /// before its first event. Default 0.
    pub latency_ms: u64,
    /// Extra latency per generated output token, in microseconds; a stream spends it
    /// before each token event. Default 0.
    pub latency_per_output_token_us: u64,
    /// Completion tokens generated per request (per choice, with `n`), capped by the
    /// request's `max_tokens` / `max_completion_tokens`. Default 16.
    pub output_tokens: u64,
    /// `false` behaves like DeepSeek: no rate-limit headers and no `retry-after`
    /// headers on 429s. Default true.
    pub send_rate_limit_headers: bool,
    /// Projects (accounts). Keys of one project share its buckets. Default none,
    /// which makes every model request a 401.
    pub projects: Vec<ProjectConfig>,
    /// Optional fault windows. Default none.
    pub faults: Vec<FaultConfig>,
    /// Random faults mixed into every model request. Default: all shares 0 (none).
    pub fault_mix: FaultMix,
    /// The batch APIs (OpenAI Batch, Anthropic Message Batches): speed and failures.
    pub batch: BatchMockConfig,
    /// Every n-th chat call at the flex tier (`service_tier: "flex"`, 1-based over the
    /// mock) is refused with OpenAI's 429 "Resource Unavailable", charging nothing; 0 =
    /// none. Default 0.
    pub flex_unavailable_every_nth: u64,
}

/// How the mock's batch APIs process lines. Deterministic, so tests can count on it.
#[derive(Debug, Clone, Copy, Deserialize, Serialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct BatchMockConfig {
    /// Lines processed per second from a batch's creation; 0 = a batch ends as soon as
    /// it is created. Default 1000.
    pub lines_per_sec: f64,
    /// Every n-th line (1-based) fails (OpenAI: error file with a 500 response; Anthropic:
    /// `errored`); 0 = none. Default 0.
    pub fail_every_nth: u64,
    /// Every n-th line (1-based, unless already failing) expires unprocessed (OpenAI: the
    /// batch ends `expired`, the line in the error file as `batch_expired`; Anthropic:
    /// `expired`); 0 = none. Default 0.
    pub expire_every_nth: u64,
}

impl Default for BatchMockConfig {
    fn default() -> Self {
        Self {
            lines_per_sec: 1000.0,
            fail_every_nth: 0,
            expire_every_nth: 0,
        }
    }
}

impl Default for MockConfig {
    fn default() -> Self {
        Self {
            latency_ms: 0,
            latency_per_output_token_us: 0,
            output_tokens: 16,
            send_rate_limit_headers: true,
            projects: Vec::new(),
            faults: Vec::new(),
            fault_mix: FaultMix::default(),
            batch: BatchMockConfig::default(),
            flex_unavailable_every_nth: 0,
        }
    }
}

/// Which provider's API a project speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ProviderKind {
    /// `POST /v1/chat/completions`, `Authorization: Bearer`.
    Openai,
    /// `POST /v1/messages`, `x-api-key` + `anthropic-version`.
    Anthropic,
    /// `POST /v1beta/models/{model}:generateContent`, `x-goog-api-key`; no rate-limit
    /// headers, 429 bodies with `QuotaFailure` and `RetryInfo`. TPM counts as Gemini's
    /// input-token quota in those bodies.
    Gemini,
    /// `POST /openai/deployments/{deployment}/chat/completions?api-version=…`, `api-key`;
    /// `x-ratelimit-remaining-*` headers, 429s with `retry-after(-ms)` and code `"429"`.
    Azure,
    /// `POST /model/{model}/converse(-stream)`, SigV4-signed by keys written
    /// `ACCESS_KEY_ID:SECRET`; no rate-limit headers, 429 `ThrottlingException`.
    Bedrock,
    /// Vertex AI: `POST /v1/projects/{project}/locations/{location}/publishers/{google|anthropic}/models/{model}:{method}`
    /// with a bearer token from `POST /token` (a service account's JWT, verified with the
    /// project's `public_key`); keys are the service accounts' emails.
    Vertex,
}

/// One project (an account with its own rate limits).
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ProjectConfig {
    /// Unique name; used in `/mock/limits/{project}` and in error messages
    /// (`organization org-<name>`).
    pub name: String,
    /// Which API the project's keys are accepted on.
    pub kind: ProviderKind,
    /// Valid keys; all keys of a project share its buckets.
    pub keys: Vec<String>,
    /// Keys answered with a 401 in the provider's shape.
    #[serde(default)]
    pub revoked_keys: Vec<String>,
    /// A `vertex` project: the PEM public key its service accounts' token requests are
    /// verified with.
    #[serde(default)]
    pub public_key: Option<String>,
    /// Accepted models; empty accepts any model, otherwise an unknown model is a 404.
    #[serde(default)]
    pub models: Vec<String>,
    /// Requests per minute; 0 = unlimited.
    #[serde(default)]
    pub rpm: u64,
    /// Tokens per minute, charged `input + max_tokens` (or `output_tokens` when the
    /// request has no max) at admission and never corrected; 0 = unlimited.
    #[serde(default)]
    pub tpm: u64,
    /// Requests per UTC day (fixed window, resets at UTC midnight), Groq-like; 0 = unlimited.
    #[serde(default)]
    pub rpd: u64,
    /// Input tokens per minute (Anthropic ITPM); 0 = unlimited.
    #[serde(default)]
    pub itpm: u64,
    /// Output tokens per minute (Anthropic OTPM), charged `max_tokens` at admission and
    /// corrected to the tokens actually generated when the response is done (for a
    /// stream the client dropped: the tokens sent until then); 0 = unlimited.
    #[serde(default)]
    pub otpm: u64,
}

impl ProjectConfig {
    /// The project's limits as a [`ProjectLimits`].
    pub fn limits(&self) -> ProjectLimits {
        ProjectLimits {
            rpm: self.rpm,
            tpm: self.tpm,
            rpd: self.rpd,
            itpm: self.itpm,
            otpm: self.otpm,
        }
    }
}

/// A project's limits; every field 0 = unlimited. Used by
/// [`super::MockProvider::set_limits`] and `POST /mock/limits/{project}`, where it is a
/// full replacement: an absent field means unlimited, not "unchanged".
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProjectLimits {
    /// Requests per minute.
    pub rpm: u64,
    /// Tokens per minute (input + max output).
    pub tpm: u64,
    /// Requests per UTC day.
    pub rpd: u64,
    /// Input tokens per minute.
    pub itpm: u64,
    /// Output tokens per minute.
    pub otpm: u64,
}

/// A window of time during which (a fraction of) requests fail with a 5xx.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct FaultConfig {
    /// Project the window applies to; all projects if absent.
    #[serde(default)]
    pub project: Option<String>,
    /// Start, in ms after the provider was created. Default 0.
    #[serde(default)]
    pub start_ms: u64,
    /// Length in ms; 0 = until the provider stops. Default 0.
    #[serde(default)]
    pub duration_ms: u64,
    /// 500, 503 or 529 (529 = Anthropic `overloaded_error`); any 5xx is accepted.
    /// Default 503.
    #[serde(default = "default_fault_status")]
    pub status: u16,
    /// Fraction of the requests in the window that fail, 0.0..=1.0. Default 1.0.
    #[serde(default = "default_probability")]
    pub probability: f64,
}

fn default_fault_status() -> u16 {
    503
}

fn default_probability() -> f64 {
    1.0
}

/// Faults injected at random into model requests on the OpenAI and Anthropic APIs (all
/// projects; a streamed 200 is never spoiled), each kind with its share of the requests: the failures a real provider or the network
/// in between produces now and then. One draw per request from an RNG seeded with
/// `seed`, so a run's sequence of faults is reproducible. Every share defaults to 0; the
/// shares may add up to at most 1.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultMix {
    /// Seed of the fault draws. Default 0.
    pub seed: u64,
    /// 500 `server_error` / `api_error`, before admission (nothing charged).
    pub http_500: f64,
    /// 503 "overloaded or not ready", before admission.
    pub http_503: f64,
    /// 529 (Anthropic `overloaded_error`; OpenAI's body shape on OpenAI routes), before
    /// admission.
    pub http_529: f64,
    /// The connection is closed without a reply, before admission.
    pub reset: f64,
    /// No reply for `hang_ms`, past any sensible client timeout, then a 504; before
    /// admission.
    pub hang: f64,
    /// How long a `hang` lasts, in ms. Default 0 = 60 000.
    pub hang_ms: u64,
    /// An admitted 200 whose JSON body is cut in half (the request was served and counts
    /// against the limits).
    pub truncated: f64,
    /// A 200 `text/html` error page instead of JSON, before admission (what a proxy in
    /// front of the provider sends).
    pub non_json: f64,
    /// An admitted 200 whose body has no `usage` object.
    pub no_usage: f64,
}

impl FaultMix {
    /// The shares in [`super::faults::Injected`] order.
    pub(crate) fn shares(&self) -> [f64; 8] {
        [
            self.http_500,
            self.http_503,
            self.http_529,
            self.reset,
            self.hang,
            self.truncated,
            self.non_json,
            self.no_usage,
        ]
    }

    /// The same share for every kind (tests, chaos runs).
    pub fn uniform(seed: u64, share: f64) -> Self {
        Self {
            seed,
            http_500: share,
            http_503: share,
            http_529: share,
            reset: share,
            hang: share,
            hang_ms: 0,
            truncated: share,
            non_json: share,
            no_usage: share,
        }
    }
}

/// Why a mock configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum MockConfigError {
    /// The file could not be read.
    #[error("cannot read mock config {path}: {source}")]
    Read {
        /// File that was read.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// The text is not valid TOML for [`MockConfig`].
    #[error("invalid mock config TOML: {0}")]
    Parse(#[from] toml::de::Error),
    /// The TOML parsed but is inconsistent (duplicate names or keys, bad fault window…).
    #[error("invalid mock config: {0}")]
    Invalid(String),
}

impl MockConfig {
    /// Parses and validates a TOML document.
    pub fn from_toml_str(s: &str) -> Result<Self, MockConfigError> {
        let config: MockConfig = toml::from_str(s)?;
        config.validate()?;
        Ok(config)
    }

    /// Reads, parses and validates a TOML file.
    pub fn load(path: &Path) -> Result<Self, MockConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| MockConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_toml_str(&text)
    }

    /// Checks what serde cannot: unique project names and keys, known fault projects,
    /// 5xx fault statuses and probabilities in 0..=1. [`super::MockProvider::new`]
    /// tolerates an invalid config (first name/key wins), so call this on configs
    /// built in code.
    pub fn validate(&self) -> Result<(), MockConfigError> {
        let invalid = |msg: String| Err(MockConfigError::Invalid(msg));
        let mut names = HashSet::new();
        let mut keys = HashSet::new();
        for p in &self.projects {
            if p.name.is_empty() || p.name.contains('/') {
                return invalid(format!("project name {:?} must be non-empty without '/'", p.name));
            }
            if !names.insert(p.name.as_str()) {
                return invalid(format!("duplicate project name {:?}", p.name));
            }
            for k in p.keys.iter().chain(&p.revoked_keys) {
                if k.is_empty() {
                    return invalid(format!("project {:?} has an empty key", p.name));
                }
                if !keys.insert(k.as_str()) {
                    // The key itself is not echoed: configs may hold realistic-looking keys.
                    return invalid(format!("project {:?} repeats a key used elsewhere", p.name));
                }
            }
        }
        for (i, f) in self.faults.iter().enumerate() {
            let unknown = f.project.as_ref().filter(|p| !names.contains(p.as_str()));
            if let Some(project) = unknown {
                return invalid(format!("fault #{i} names unknown project {project:?}"));
            }
            if !(500..=599).contains(&f.status) {
                return invalid(format!("fault #{i} status {} is not a 5xx", f.status));
            }
            if !(0.0..=1.0).contains(&f.probability) {
                return invalid(format!(
                    "fault #{i} probability {} is not in 0..=1",
                    f.probability
                ));
            }
        }
        let shares = self.fault_mix.shares();
        if shares.iter().any(|s| !(0.0..=1.0).contains(s)) || shares.iter().sum::<f64>() > 1.0 + 1e-9 {
            return invalid("fault_mix shares must each be in 0..=1 and add up to at most 1".to_owned());
        }
        Ok(())
    }
}
