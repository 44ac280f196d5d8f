//! Configuration: the TOML file (`--config` or `TOLLGATE_CONFIG`), its defaults, and
//! validation at start with errors that name the offending field.
//!
//! Every field is documented in the README's configuration reference; a field added here
//! is added there in the same commit.

use std::collections::{BTreeMap, HashSet};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;

use crate::tenant_spec::{Allowance, Budget, BudgetWindow, TenantLimits, TenantSettings, TenantSpec};
use crate::vocab::{Authority, Dialect, Endpoint, JobClass, PriceSource};

mod batches;
mod flex;
mod provider_batches;
pub use batches::{BatchesConfig, RetentionConfig, WebhookEndpointConfig, WebhooksConfig};
pub use flex::FlexConfig;
pub use provider_batches::BatchApiConfig;

/// Why a configuration could not be used. Messages name the file and field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("config {origin}: {message}")]
    Parse { origin: String, message: String },
    #[error("config field `{field}`: {reason}")]
    Invalid { field: String, reason: String },
}

fn invalid(field: impl Into<String>, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.into(),
        reason: reason.into(),
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    #[serde(default)]
    pub server: ServerConfig,
    #[serde(default)]
    pub database: DatabaseConfig,
    #[serde(default)]
    pub dispatch: DispatchConfig,
    #[serde(default)]
    pub retry: RetryConfig,
    #[serde(default)]
    pub gate: GateConfig,
    #[serde(default)]
    pub classes: ClassesConfig,
    pub providers: Vec<ProviderConfig>,
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// None is fine with `server.admin_key`: tenants are then made through the admin API.
    #[serde(default)]
    pub tenants: Vec<TenantConfig>,
    /// What a tenant may keep stored, unless its `[[tenants]]` entry says otherwise.
    #[serde(default)]
    pub quotas: Quotas,
    /// Bulk JSONL (Files and Batch APIs) limits.
    #[serde(default)]
    pub batches: BatchesConfig,
    /// How long finished jobs, batches and files are kept.
    #[serde(default)]
    pub retention: RetentionConfig,
    /// Signed event notifications (Standard Webhooks).
    #[serde(default)]
    pub webhooks: WebhooksConfig,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address the API listens on.
    pub listen: SocketAddr,
    /// Largest request body accepted; larger bodies get 413 `body_too_large`.
    pub max_body_bytes: usize,
    /// Largest body of `POST /v1/jobs/bulk`.
    pub max_bulk_body_bytes: usize,
    /// Most jobs in one `POST /v1/jobs/bulk`.
    pub max_bulk_jobs: usize,
    /// Longest `?wait=` a long-poll may ask for, in seconds; longer asks are clamped.
    pub max_wait_secs: u64,
    /// How long `POST /v1/chat/completions` waits for its job before answering 429.
    pub sync_timeout_secs: u64,
    /// The operators' key (or `admin_key_env`, the variable holding it): sees every tenant
    /// on the dashboard and `/v1/status`, and is required by `/metrics` when set. Unset:
    /// nobody sees other tenants, and `/metrics` is open.
    pub admin_key: Option<SecretString>,
    pub admin_key_env: Option<String>,
    /// Requests per second one tenant may make to the API (a token bucket per tenant, in
    /// each process), a bulk counting once per job it holds; past it, 429
    /// `api_rate_limited` with Retry-After. Protects the API and the database from one
    /// client's loop or flood.
    pub api_rate_per_sec: f64,
    /// Requests a tenant may make at once above `api_rate_per_sec` (the bucket's size).
    pub api_burst: f64,
    /// Largest total size of a request's headers (names and values); larger get 431
    /// `headers_too_large` before any handler or key lookup runs.
    pub max_header_bytes: usize,
    /// Seconds a client has to send a request's headers, counted from when the connection
    /// opens or its last response ended (so it also closes idle keep-alive connections).
    pub header_timeout_secs: u64,
    /// Longest pause, in seconds, while a request's body arrives; then 408 `request_timeout`.
    pub body_idle_timeout_secs: u64,
    /// Connections served at once; one more is answered 503 `server_busy` and closed.
    pub max_connections: usize,
    /// Connections one source (an IPv4 address, an IPv6 /64) may hold at once; one more is
    /// answered 503 `server_busy` and closed. Behind a load balancer or proxy every
    /// connection comes from its address: raise this to `max_connections` there.
    pub max_connections_per_source: usize,
    /// Requests per second one source address (an IPv4 address, an IPv6 /64) may make
    /// without a valid key — none, a wrong one, or to an anonymous endpoint — in each
    /// process; past it, 429 `api_rate_limited`. Key guessing and floods of anonymous
    /// requests cost a hash each at this rate and nothing beyond it. `/healthz` and
    /// `/readyz` are not counted (they cost nothing; see `/readyz`).
    pub anonymous_rate_per_sec: f64,
    /// Requests a source may make at once above `anonymous_rate_per_sec`.
    pub anonymous_burst: f64,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            max_body_bytes: 2 * 1024 * 1024,
            max_bulk_body_bytes: 64 * 1024 * 1024,
            max_bulk_jobs: 10_000,
            max_wait_secs: 60,
            sync_timeout_secs: 120,
            admin_key: None,
            admin_key_env: None,
            api_rate_per_sec: 10_000.0,
            api_burst: 20_000.0,
            max_header_bytes: 16 * 1024,
            header_timeout_secs: 10,
            body_idle_timeout_secs: 30,
            max_connections: 4096,
            max_connections_per_source: 512,
            anonymous_rate_per_sec: 20.0,
            anonymous_burst: 200.0,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseConfig {
    /// PostgreSQL URL. `DATABASE_URL` in the environment wins over this field; with
    /// neither, tollgate starts its embedded PostgreSQL.
    pub url: Option<String>,
    /// Where the embedded PostgreSQL keeps its data (relative to the working directory).
    pub embedded_dir: PathBuf,
    /// Connections in this process's pool.
    pub max_connections: u32,
}

impl Default for DatabaseConfig {
    fn default() -> Self {
        Self {
            url: None,
            embedded_dir: PathBuf::from(".tollgate/pg"),
            max_connections: 16,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DispatchConfig {
    /// Provider calls in flight at once in this process. Each synchronous caller beyond it
    /// waits for a slot, so it is at least the callers one process serves at once; a call
    /// holds one connection to its provider while it runs.
    pub concurrency: usize,
    /// A claimed job's lease; a dispatcher that dies loses its jobs to the rescuer after this.
    pub lease_secs: u64,
    /// How often a live dispatcher extends the leases of its in-flight jobs.
    pub heartbeat_secs: u64,
    /// Fallback poll when no notification arrives, in milliseconds.
    pub poll_interval_ms: u64,
    /// On shutdown, how long in-flight calls may run before their leases are released.
    pub drain_timeout_secs: u64,
    /// Timeout of one provider call.
    pub request_timeout_secs: u64,
    /// How often the maintenance loop rescues expired leases and expires deadlines.
    pub maintenance_interval_ms: u64,
    /// A key the provider rejected (401, 402, 403, `insufficient_quota`) is not used again
    /// for this long; the other keys carry its work.
    pub dead_key_secs: u64,
}

impl Default for DispatchConfig {
    fn default() -> Self {
        Self {
            concurrency: 256,
            lease_secs: 30,
            heartbeat_secs: 10,
            poll_interval_ms: 1000,
            drain_timeout_secs: 20,
            request_timeout_secs: 600,
            maintenance_interval_ms: 1000,
            dead_key_secs: 600,
        }
    }
}

impl DispatchConfig {
    pub fn lease(&self) -> Duration {
        Duration::from_secs(self.lease_secs)
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetryConfig {
    /// Provider calls one job may make, first included.
    pub max_attempts: u32,
    /// First backoff; doubles per attempt, with jitter.
    pub base_delay_ms: u64,
    /// Cap of the exponential backoff (a provider's Retry-After may ask for longer).
    pub max_delay_ms: u64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            max_attempts: 6,
            base_delay_ms: 500,
            max_delay_ms: 30_000,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GateConfig {
    /// Most jobs admitted in one gate round (one transaction).
    pub batch: usize,
    /// Tokens a newly active tenant may run ahead of the others (burst credit), per unit of
    /// weight.
    pub burst_credit_tokens: u64,
    /// Provider buckets keep this many seconds of refill in reserve. A provider's bucket
    /// that is full loses the refill between tollgate's admission of a request and the
    /// request's arrival; this reserve is the admission-to-send delay the limits tolerate.
    pub headroom_secs: f64,
    /// Fallback period of the gate when nothing wakes it, in milliseconds.
    pub poll_interval_ms: u64,
    /// Fraction of each provider rate bucket that only interactive jobs may use.
    pub interactive_reserve: f64,
    /// Calls in flight to a provider model whose limits are neither configured nor yet
    /// learned: its first responses teach the limits before more is sent.
    pub probe_concurrency: u64,
    /// Requests per second first sent to a provider model whose responses say nothing of
    /// its limits (none configured): the pace doubles each second while it holds jobs back,
    /// until a 429 teaches a limit (the learned limits' pace).
    pub pace_start_rps: f64,
}

impl Default for GateConfig {
    fn default() -> Self {
        Self {
            batch: 512,
            burst_credit_tokens: 8192,
            headroom_secs: 1.0,
            poll_interval_ms: 1000,
            interactive_reserve: 0.05,
            probe_concurrency: 2,
            pace_start_rps: 10.0,
        }
    }
}

/// Per-class defaults. Interactive work is short-lived; batch work may wait a day.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClassesConfig {
    pub interactive: ClassConfig,
    pub standard: ClassConfig,
    pub background: ClassConfig,
    pub batch: ClassConfig,
}

impl Default for ClassesConfig {
    fn default() -> Self {
        let with = |secs| ClassConfig {
            default_deadline_secs: secs,
            max_queued_per_tenant: None,
            starve_after_secs: 60,
        };
        Self {
            interactive: with(120),
            standard: with(3600),
            background: with(6 * 3600),
            batch: with(24 * 3600),
        }
    }
}

impl ClassesConfig {
    /// Whether any class caps what a tenant may have waiting in it.
    pub fn any_capped(&self) -> bool {
        [&self.interactive, &self.standard, &self.background, &self.batch]
            .iter()
            .any(|c| c.max_queued_per_tenant.is_some())
    }

    pub fn get(&self, class: JobClass) -> &ClassConfig {
        match class {
            JobClass::Interactive => &self.interactive,
            JobClass::Standard => &self.standard,
            JobClass::Background => &self.background,
            JobClass::Batch => &self.batch,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClassConfig {
    /// Deadline of a job that names none, counted from acceptance.
    pub default_deadline_secs: u64,
    /// Jobs a tenant may have waiting in this class; past it, submissions get 429
    /// `queue_full` with Retry-After. None = no cap (always queue).
    #[serde(default)]
    pub max_queued_per_tenant: Option<u64>,
    /// A job waiting longer than this is considered with the interactive class, so a
    /// busy higher class cannot starve it.
    #[serde(default = "default_starve_after")]
    pub starve_after_secs: u64,
}

fn default_starve_after() -> u64 {
    60
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProviderKind {
    /// OpenAI Chat Completions at `{base_url}/chat/completions`.
    Openai,
    /// Anthropic Messages at `{base_url}/v1/messages`.
    Anthropic,
    /// Any server speaking OpenAI Chat Completions (Groq, Mistral, Together, vLLM, …).
    OpenaiCompatible,
    /// Google Gemini `generateContent` at `{base_url}/v1beta/models/{model}:generateContent`.
    Gemini,
    /// Azure OpenAI at `{base_url}/openai/deployments/{model}/chat/completions`; the
    /// model names the deployment.
    Azure,
    /// AWS Bedrock Converse at `{base_url}/model/{model}/converse`, signed with SigV4 by
    /// keys of `access_key_id` and `secret_access_key`; `base_url` defaults to
    /// `https://bedrock-runtime.{region}.amazonaws.com`. A model is a model id or an
    /// inference profile (`us.anthropic.claude-…`).
    Bedrock,
    /// Google Vertex AI: Gemini models (`publishers/google`) and Anthropic's (`claude-…`,
    /// `publishers/anthropic`) under `{base_url}/v1/projects/{project}/locations/{location}`,
    /// authorized by OAuth2 tokens a service-account key (the key's `file`, `env` or
    /// `value`: its JSON) is exchanged for; `base_url` defaults to the location's endpoint.
    Vertex,
}

impl ProviderKind {
    /// Whether tollgate sends this provider kind requests of `endpoint`: chat to every
    /// kind, embeddings to the OpenAI family (Anthropic has no embeddings API), moderations
    /// to OpenAI, legacy completions to OpenAI and OpenAI-compatible servers (as they are),
    /// Anthropic Messages and OpenAI Responses to every kind (as they are to their own
    /// APIs, translated to chat for the others: [`ProviderKind::translates`]).
    pub fn serves(self, endpoint: Endpoint) -> bool {
        match endpoint {
            Endpoint::ChatCompletions | Endpoint::Messages | Endpoint::Responses => true,
            Endpoint::Embeddings => matches!(self, Self::Openai | Self::OpenaiCompatible | Self::Azure),
            Endpoint::Completions => matches!(self, Self::Openai | Self::OpenaiCompatible),
            Endpoint::Moderations => self == Self::Openai,
        }
    }

    /// Whether requests of `endpoint` reach this kind as chat requests, their answers
    /// translated back: Anthropic Messages to every kind but Anthropic, OpenAI Responses
    /// to every kind but the OpenAI family.
    pub fn translates(self, endpoint: Endpoint) -> bool {
        match endpoint {
            Endpoint::Messages => self != Self::Anthropic,
            Endpoint::Responses => !matches!(self, Self::Openai | Self::OpenaiCompatible),
            _ => false,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderConfig {
    /// Referenced by routes and clients as `<name>/<model>`.
    pub name: String,
    pub kind: ProviderKind,
    /// As the provider's own SDK takes it: OpenAI-style ones include `/v1`; Anthropic's,
    /// Gemini's and Azure's (`https://<resource>.openai.azure.com`) are the API root.
    /// Bedrock's and Vertex's default to their region's or location's endpoint.
    #[serde(default)]
    pub base_url: String,
    pub keys: Vec<KeyConfig>,
    /// Models this provider serves; `<name>/<model>` is valid only for these.
    pub models: Vec<String>,
    /// Configured limits per model (`"*"` for all models). Enforced by the gate.
    #[serde(default)]
    pub limits: BTreeMap<String, ModelLimits>,
    /// Whether the provider charges a request's `max_tokens` against its limits when the
    /// request starts (OpenAI and Anthropic do). When false, admission reserves the output
    /// the model was seen to produce (its recent p90), capped by `max_tokens`.
    #[serde(default = "default_true")]
    pub charges_max_tokens: bool,
    /// Prices per model (`"*"` for all models), for spend estimates and budgets.
    #[serde(default)]
    pub prices: BTreeMap<String, ModelPrice>,
    /// `anthropic-version` header sent to Anthropic.
    #[serde(default = "default_anthropic_version")]
    pub anthropic_version: String,
    /// `api-version` query parameter sent to Azure OpenAI.
    #[serde(default = "default_azure_api_version")]
    pub azure_api_version: String,
    /// Which rate-limit headers the provider sends (`openai`, `groq`, `anthropic`,
    /// `mistral`, `together`, `azure`, `gemini`, `none`). Default: by `kind`.
    #[serde(default)]
    pub dialect: Option<Dialect>,
    /// Learn limits from responses (headers, 429 bodies, 429s). Default true.
    #[serde(default = "default_true")]
    pub learn_limits: bool,
    /// `config` (default): configured limits are an upper bound on learned ones;
    /// `provider`: what the provider reports replaces them.
    #[serde(default)]
    pub limit_authority: Authority,
    /// The provider's own batch API as a scheduling choice for `batch`-class jobs.
    #[serde(default)]
    pub batch_api: BatchApiConfig,
    /// The provider's flex tier as a lane for jobs whose deadline leaves it time.
    #[serde(default)]
    pub flex: FlexConfig,
    /// AWS region of a `bedrock` provider (`us-east-1`): its endpoint and signing scope.
    #[serde(default)]
    pub region: Option<String>,
    /// Google Cloud project of a `vertex` provider.
    #[serde(default)]
    pub project: Option<String>,
    /// Location of a `vertex` provider (`us-central1`, `europe-west4`, `global`).
    #[serde(default)]
    pub location: Option<String>,
}

/// USD per million tokens.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ModelPrice {
    pub input_per_mtok: f64,
    pub output_per_mtok: f64,
    #[serde(default)]
    pub cached_input_per_mtok: Option<f64>,
    /// Fraction of the price charged through the provider's batch API (e.g. 0.5).
    #[serde(default)]
    pub batch_discount: Option<f64>,
}

impl ProviderConfig {
    /// The configured limits of `model` (its own entry, else `"*"`).
    pub fn limits_for(&self, model: &str) -> Option<&ModelLimits> {
        self.limits.get(model).or_else(|| self.limits.get("*"))
    }

    /// The rate-limit dialect: configured, else the kind's.
    pub fn dialect(&self) -> Dialect {
        self.dialect.unwrap_or(match self.kind {
            ProviderKind::Anthropic => Dialect::Anthropic,
            ProviderKind::Openai | ProviderKind::OpenaiCompatible => Dialect::Openai,
            ProviderKind::Gemini | ProviderKind::Vertex => Dialect::Gemini,
            ProviderKind::Azure => Dialect::Azure,
            ProviderKind::Bedrock => Dialect::None,
        })
    }

    /// The endpoint a `bedrock` or `vertex` provider without a `base_url` is sent to.
    fn default_base_url(&self) -> Option<String> {
        match (self.kind, &self.region, &self.location) {
            (ProviderKind::Bedrock, Some(region), _) => {
                Some(format!("https://bedrock-runtime.{region}.amazonaws.com"))
            }
            (ProviderKind::Vertex, _, Some(location)) if location == "global" => {
                Some("https://aiplatform.googleapis.com".to_owned())
            }
            (ProviderKind::Vertex, _, Some(location)) => {
                Some(format!("https://{location}-aiplatform.googleapis.com"))
            }
            _ => None,
        }
    }

    /// What a provider of this kind needs besides the fields every kind has: a region
    /// for Bedrock, a project and location for Vertex (as `(field, reason)`).
    fn kind_fault(&self) -> Option<(&'static str, &'static str)> {
        let named = |v: &Option<String>| {
            v.as_deref()
                .is_some_and(|v| !v.is_empty() && v.chars().all(|c| c.is_ascii_alphanumeric() || c == '-'))
        };
        match self.kind {
            ProviderKind::Bedrock if !named(&self.region) => {
                Some(("region", "a bedrock provider needs its AWS `region` (us-east-1)"))
            }
            ProviderKind::Vertex if !named(&self.project) => {
                Some(("project", "a vertex provider needs its Google Cloud `project` id"))
            }
            ProviderKind::Vertex if !named(&self.location) => Some((
                "location",
                "a vertex provider needs its `location` (us-central1, global)",
            )),
            _ => None,
        }
    }

    /// Whether the config limits requests or tokens of `model` (else its limits are
    /// learned, starting with a cold-start probe).
    pub fn configures_rates(&self, model: &str) -> bool {
        self.limits_for(model).is_some_and(|l| {
            [l.rpm, l.tpm, l.itpm, l.otpm, l.rpd, l.ramp_rpm]
                .iter()
                .any(Option::is_some)
        })
    }

    pub fn price_for(&self, model: &str) -> Option<&ModelPrice> {
        self.priced(model).0
    }

    /// The price of `model` and where it comes from: its own, else the provider's `"*"`.
    pub fn priced(&self, model: &str) -> (Option<&ModelPrice>, PriceSource) {
        match (self.prices.get(model), self.prices.get("*")) {
            (Some(p), _) => (Some(p), PriceSource::Model),
            (None, Some(p)) => (Some(p), PriceSource::Provider),
            (None, None) => (None, PriceSource::Unpriced),
        }
    }
}

fn default_true() -> bool {
    true
}

fn default_anthropic_version() -> String {
    "2023-06-01".to_owned()
}

fn default_azure_api_version() -> String {
    "2024-10-21".to_owned()
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeyConfig {
    pub name: String,
    /// The key itself. Prefer `env` outside tests and demos.
    pub value: Option<SecretString>,
    /// Name of the environment variable holding the key.
    pub env: Option<String>,
    /// A file holding the key: a `vertex` provider's service-account JSON key.
    #[serde(default)]
    pub file: Option<String>,
    /// A `bedrock` key: the AWS access key id, or the environment variable holding it.
    #[serde(default)]
    pub access_key_id: Option<String>,
    #[serde(default)]
    pub access_key_id_env: Option<String>,
    /// A `bedrock` key: its secret access key, or the environment variable holding it.
    #[serde(default)]
    pub secret_access_key: Option<SecretString>,
    #[serde(default)]
    pub secret_access_key_env: Option<String>,
    /// A `bedrock` key of temporary credentials (STS, an instance or pod role): its
    /// session token, or the environment variable holding it.
    #[serde(default)]
    pub session_token: Option<SecretString>,
    #[serde(default)]
    pub session_token_env: Option<String>,
    /// Limits of this key alone, across all models (on top of the provider's per-model
    /// limits, which all its keys share).
    #[serde(default)]
    pub limits: Option<ModelLimits>,
    /// Models this key may be used for; empty = all of the provider's models.
    #[serde(default)]
    pub models: Vec<String>,
    /// Share of the provider's requests this key gets, relative to its other keys.
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// The provider account (quota pool) this key's calls count against, for providers
    /// whose responses do not name it (a Gemini key's Google Cloud project): keys declaring
    /// different accounts have their limits learned apart from their first call. It
    /// stands over what responses name.
    #[serde(default)]
    pub account: Option<String>,
}

impl KeyConfig {
    /// May this key serve `model`?
    pub fn serves(&self, model: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|m| m == model)
    }
}

#[derive(Debug, Clone, Default, Deserialize, serde::Serialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct ModelLimits {
    /// Most growth of the requests per minute from one minute to the next (acceleration
    /// limits): a minute allows the previous minute's requests plus this.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ramp_rpm: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rpm: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tpm: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub itpm: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub otpm: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rpd: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u64>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// What clients put in `model`.
    pub alias: String,
    /// `provider/model` targets in order of preference.
    pub targets: Vec<String>,
    /// The route's own share: limits on all jobs sent through this alias, whichever
    /// target serves them.
    #[serde(default)]
    pub limits: Option<ModelLimits>,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    pub name: String,
    /// The tenant's API key; only its SHA-256 is kept in memory.
    pub api_key: Option<SecretString>,
    /// Name of the environment variable holding the tenant's API key.
    pub api_key_env: Option<String>,
    /// The SHA-256 of the tenant's API key, in hex: the key itself never appears in the
    /// config (`printf %s "$KEY" | sha256sum`).
    pub api_key_sha256: Option<String>,
    /// Share of contended capacity relative to other tenants.
    #[serde(default = "default_weight")]
    pub weight: u32,
    /// Requests per minute across all the tenant's jobs.
    #[serde(default)]
    pub rpm: Option<u64>,
    /// Tokens (input + output) per minute.
    #[serde(default)]
    pub tpm: Option<u64>,
    /// Requests per UTC day.
    #[serde(default)]
    pub rpd: Option<u64>,
    /// Provider calls in flight at once.
    #[serde(default)]
    pub concurrency: Option<u64>,
    /// Spend per UTC day, in USD, priced with `providers[].prices`.
    #[serde(default)]
    pub daily_spend_usd: Option<f64>,
    /// Spend per week (from Monday 00:00 UTC), in USD.
    #[serde(default)]
    pub weekly_spend_usd: Option<f64>,
    /// Spend per calendar month (UTC), in USD.
    #[serde(default)]
    pub monthly_spend_usd: Option<f64>,
    /// A tenant (of this file) whose limits and budgets also cover this one.
    #[serde(default)]
    pub parent: Option<String>,
    /// Its applications' own limits and budgets (`[tenants.applications.<name>]`), shared
    /// by the tenant's keys labelled with each (keys made through the admin API).
    #[serde(default)]
    pub applications: BTreeMap<String, ApplicationConfig>,
    /// This tenant's `quotas.max_files`.
    #[serde(default)]
    pub max_files: Option<u64>,
    /// This tenant's `quotas.max_stored_file_bytes`.
    #[serde(default)]
    pub max_stored_file_bytes: Option<u64>,
    /// This tenant's `server.api_rate_per_sec`.
    #[serde(default)]
    pub api_rate_per_sec: Option<f64>,
    /// This tenant's `server.api_burst`.
    #[serde(default)]
    pub api_burst: Option<f64>,
}

/// Requests a second one tenant may make to one API process, and its burst
/// (`server.api_rate_per_sec` / `api_burst`, or the tenant's own).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ApiRate {
    pub per_sec: f64,
    pub burst: f64,
}

impl ApiRate {
    /// Why the rate is unusable, if it is.
    fn check(&self) -> Option<(&'static str, &'static str)> {
        if !(self.per_sec.is_finite() && self.per_sec > 0.0) {
            Some(("api_rate_per_sec", "must be a positive number"))
        } else if !(self.burst.is_finite() && self.burst >= 1.0) {
            Some(("api_burst", "must be at least 1"))
        } else {
            None
        }
    }
}

impl RouteConfig {
    /// The first thing wrong with this route of `config` (a route of the file, or one
    /// added at runtime): the field and the reason.
    pub fn fault(&self, config: &Config) -> Option<(String, String)> {
        if self.alias.is_empty() || self.alias.contains('/') {
            return Some(("alias".into(), "must be non-empty and contain no '/'".into()));
        }
        if self.targets.is_empty() {
            return Some(("targets".into(), "at least one target is required".into()));
        }
        let (t, target) = self
            .targets
            .iter()
            .enumerate()
            .find(|(_, t)| config.provider_target(t).is_none())?;
        Some((
            format!("targets[{t}]"),
            format!("{target:?} is not <provider>/<model> of a configured provider and model"),
        ))
    }
}

/// `[tenants.applications.<name>]`: one application's limits and budgets, named as a
/// tenant's are.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ApplicationConfig {
    #[serde(default)]
    pub rpm: Option<u64>,
    #[serde(default)]
    pub tpm: Option<u64>,
    #[serde(default)]
    pub rpd: Option<u64>,
    #[serde(default)]
    pub concurrency: Option<u64>,
    #[serde(default)]
    pub daily_spend_usd: Option<f64>,
    #[serde(default)]
    pub weekly_spend_usd: Option<f64>,
    #[serde(default)]
    pub monthly_spend_usd: Option<f64>,
}

impl ApplicationConfig {
    fn allowance(&self) -> Allowance {
        Allowance {
            limits: TenantLimits {
                rpm: self.rpm,
                tpm: self.tpm,
                rpd: self.rpd,
                concurrency: self.concurrency,
            },
            budgets: budgets_of(
                self.daily_spend_usd,
                self.weekly_spend_usd,
                self.monthly_spend_usd,
            ),
        }
    }
}

/// Budgets from the file's `daily_spend_usd`, `weekly_spend_usd` and `monthly_spend_usd`.
fn budgets_of(day: Option<f64>, week: Option<f64>, month: Option<f64>) -> Vec<Budget> {
    [
        (BudgetWindow::Day, day),
        (BudgetWindow::Week, week),
        (BudgetWindow::Month, month),
    ]
    .into_iter()
    .filter_map(|(window, usd)| Some(Budget { window, usd: usd? }))
    .collect()
}

impl TenantConfig {
    /// The tenant this entry describes.
    pub fn spec(&self) -> TenantSpec {
        TenantSpec {
            name: self.name.clone(),
            weight: self.weight,
            parent: self.parent.clone(),
            limits: TenantLimits {
                rpm: self.rpm,
                tpm: self.tpm,
                rpd: self.rpd,
                concurrency: self.concurrency,
            },
            budgets: budgets_of(
                self.daily_spend_usd,
                self.weekly_spend_usd,
                self.monthly_spend_usd,
            ),
            applications: self
                .applications
                .iter()
                .map(|(name, app)| (name.clone(), app.allowance()))
                .collect(),
            settings: TenantSettings {
                max_files: self.max_files,
                max_stored_file_bytes: self.max_stored_file_bytes,
                api_rate_per_sec: self.api_rate_per_sec,
                api_burst: self.api_burst,
            },
        }
    }
}

fn default_weight() -> u32 {
    1
}

/// `[quotas]`: what one tenant may keep stored, so that one tenant cannot fill the
/// database's disk or its file listings. Each `[[tenants]]` entry may set its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Quotas {
    /// Files a tenant may keep: its uploads and its batches' output and error files. An
    /// upload beyond it gets 429 `quota_exceeded`; output files are never refused (they
    /// count, so a tenant at its quota deletes files before uploading more).
    pub max_files: u64,
    /// Bytes all of a tenant's files may hold together. An upload that would cross it is
    /// refused (429 `quota_exceeded`) as soon as it does, and nothing of it is kept.
    pub max_stored_file_bytes: u64,
}

impl Default for Quotas {
    fn default() -> Self {
        Self {
            max_files: 10_000,
            max_stored_file_bytes: 10 * 1024 * 1024 * 1024,
        }
    }
}

impl Config {
    /// Reads, parses and validates a config file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string())
    }

    /// Parses and validates config text; `origin` names it in errors.
    ///
    /// Errors keep toml's own text: the line and column, the offending line and a caret
    /// under it. So the typed parse reads the text itself, not the `toml::Value` the
    /// duration check walks: a value has no positions left to point at.
    pub fn parse(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let parse_error = |e: toml::de::Error| ConfigError::Parse {
            origin: origin.to_owned(),
            message: e.to_string().trim_end().to_owned(),
        };
        let raw: toml::Value = toml::from_str(text).map_err(parse_error)?;
        check_durations(&raw, "")?;
        let mut config: Config = toml::from_str(text).map_err(parse_error)?;
        for p in &mut config.providers {
            if p.base_url.is_empty()
                && let Some(url) = p.default_base_url()
            {
                p.base_url = url;
            }
        }
        config.validate()?;
        Ok(config)
    }

    /// Checks what serde cannot: references, uniqueness, secrets present.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.providers.is_empty() {
            return Err(invalid("providers", "at least one provider is required"));
        }
        if self.tenants.is_empty() && self.server.admin_key.is_none() && self.server.admin_key_env.is_none() {
            return Err(invalid(
                "tenants",
                "at least one tenant is required, or `server.admin_key` to create tenants through the admin API",
            ));
        }
        if self.dispatch.concurrency == 0 {
            return Err(invalid("dispatch.concurrency", "must be at least 1"));
        }
        if self.dispatch.heartbeat_secs == 0 || self.dispatch.heartbeat_secs >= self.dispatch.lease_secs {
            return Err(invalid(
                "dispatch.heartbeat_secs",
                "must be at least 1 and shorter than dispatch.lease_secs",
            ));
        }
        if self.gate.batch == 0 {
            return Err(invalid("gate.batch", "must be at least 1"));
        }
        if !(0.0..1.0).contains(&self.gate.interactive_reserve) {
            return Err(invalid(
                "gate.interactive_reserve",
                "must be at least 0 and below 1",
            ));
        }
        if !(self.gate.headroom_secs.is_finite() && self.gate.headroom_secs >= 0.0) {
            return Err(invalid("gate.headroom_secs", "must be a non-negative number"));
        }
        if !(self.gate.pace_start_rps.is_finite() && self.gate.pace_start_rps >= 1.0) {
            return Err(invalid("gate.pace_start_rps", "must be a number of at least 1"));
        }
        if let Some((field, reason)) = self.server.api_rate().check() {
            return Err(invalid(format!("server.{field}"), reason));
        }
        if self.server.max_header_bytes < 1024 {
            return Err(invalid("server.max_header_bytes", "must be at least 1024"));
        }
        for (field, secs) in [
            ("server.header_timeout_secs", self.server.header_timeout_secs),
            (
                "server.body_idle_timeout_secs",
                self.server.body_idle_timeout_secs,
            ),
        ] {
            if !(1..=3600).contains(&secs) {
                return Err(invalid(field, "must be from 1 to 3600 seconds"));
            }
        }
        if self.server.max_connections == 0 {
            return Err(invalid("server.max_connections", "must be at least 1"));
        }
        if self.server.max_connections_per_source == 0 {
            return Err(invalid("server.max_connections_per_source", "must be at least 1"));
        }
        if !(self.server.anonymous_rate_per_sec.is_finite() && self.server.anonymous_rate_per_sec > 0.0) {
            return Err(invalid(
                "server.anonymous_rate_per_sec",
                "must be a positive number",
            ));
        }
        if !(self.server.anonymous_burst.is_finite() && self.server.anonymous_burst >= 1.0) {
            return Err(invalid("server.anonymous_burst", "must be at least 1"));
        }
        if self.retry.max_attempts == 0 {
            return Err(invalid("retry.max_attempts", "must be at least 1"));
        }
        let mut names = HashSet::new();
        for (i, p) in self.providers.iter().enumerate() {
            let at = |f: &str| format!("providers[{i}].{f}");
            if p.name.is_empty() || p.name.contains('/') {
                return Err(invalid(at("name"), "must be non-empty and contain no '/'"));
            }
            if !names.insert(p.name.as_str()) {
                return Err(invalid(
                    at("name"),
                    format!("duplicate provider name {:?}", p.name),
                ));
            }
            if let Some((field, reason)) = p.kind_fault() {
                return Err(invalid(at(field), reason));
            }
            let url = reqwest_free_url_check(&p.base_url);
            if let Err(reason) = url {
                return Err(invalid(at("base_url"), reason));
            }
            if p.keys.is_empty() {
                return Err(invalid(at("keys"), "at least one key is required"));
            }
            p.batch_api
                .validate(p.kind)
                .map_err(|reason| invalid(at("batch_api"), reason))?;
            p.flex
                .validate(p.kind)
                .map_err(|reason| invalid(at("flex"), reason))?;
            for (k, key) in p.keys.iter().enumerate() {
                let secret = key
                    .resolve()
                    .map_err(|reason| invalid(format!("providers[{i}].keys[{k}]"), reason))?;
                if let Some(reason) = key_fault(p.kind, &secret) {
                    return Err(invalid(format!("providers[{i}].keys[{k}]"), reason));
                }
                if key.weight == 0 {
                    return Err(invalid(
                        format!("providers[{i}].keys[{k}].weight"),
                        "must be at least 1",
                    ));
                }
                if key
                    .account
                    .as_deref()
                    .is_some_and(|a| !crate::tenant_spec::valid_name(a))
                {
                    return Err(invalid(
                        format!("providers[{i}].keys[{k}].account"),
                        crate::tenant_spec::name_rule(),
                    ));
                }
                if let Some(m) = key.models.iter().find(|m| !p.models.contains(m)) {
                    return Err(invalid(
                        format!("providers[{i}].keys[{k}].models"),
                        format!("{m:?} is not in this provider's `models`"),
                    ));
                }
            }
            if let Some(m) = p.models.iter().find(|m| !p.keys.iter().any(|k| k.serves(m))) {
                return Err(invalid(
                    format!("providers[{i}].keys"),
                    format!("no key may serve model {m:?}"),
                ));
            }
            if p.models.is_empty() {
                return Err(invalid(at("models"), "at least one model is required"));
            }
            for model in p.prices.keys() {
                if model != "*" && !p.models.contains(model) {
                    return Err(invalid(
                        format!("providers[{i}].prices.{model}"),
                        "names a model not in this provider's `models` (use \"*\" for all)",
                    ));
                }
            }
            for model in p.limits.keys() {
                if model != "*" && !p.models.contains(model) {
                    return Err(invalid(
                        format!("providers[{i}].limits.{model}"),
                        "names a model not in this provider's `models` (use \"*\" for all)",
                    ));
                }
            }
        }
        let mut aliases = HashSet::new();
        for (i, r) in self.routes.iter().enumerate() {
            if let Some((field, reason)) = r.fault(self) {
                return Err(invalid(format!("routes[{i}].{field}"), reason));
            }
            if !aliases.insert(r.alias.as_str()) {
                return Err(invalid(
                    format!("routes[{i}].alias"),
                    format!("duplicate alias {:?}", r.alias),
                ));
            }
        }
        let mut tenant_names = HashSet::new();
        for (i, t) in self.tenants.iter().enumerate() {
            t.spec()
                .check()
                .map_err(|e| invalid(format!("tenants[{i}].{}", tenant_field(t, &e.field)), e.reason))?;
            if !tenant_names.insert(t.name.as_str()) {
                return Err(invalid(
                    format!("tenants[{i}].name"),
                    format!("duplicate tenant {:?}", t.name),
                ));
            }
            t.key_sha256()
                .map_err(|reason| invalid(format!("tenants[{i}]"), reason))?;
            if let Some(key) = t.clear_key() {
                self.server.check_key(&format!("tenants[{i}].api_key"), &key)?;
            }
        }
        // A missing variable or both fields set is the tenant directory's error to give.
        if let Ok(Some(key)) = self.server.admin_key() {
            self.server.check_key("server.admin_key", &key)?;
        }
        for (i, t) in self.tenants.iter().enumerate() {
            if t.parent.as_deref().is_some_and(|p| !tenant_names.contains(p)) {
                return Err(invalid(
                    format!("tenants[{i}].parent"),
                    "must name another tenant of this file",
                ));
            }
        }
        let tenant_names: Vec<&str> = self.tenants.iter().map(|t| t.name.as_str()).collect();
        batches::validate(&self.batches, &self.retention, &self.webhooks, &tenant_names)?;
        Ok(())
    }

    pub fn provider(&self, name: &str) -> Option<&ProviderConfig> {
        self.providers.iter().find(|p| p.name == name)
    }

    /// `provider/model` → the provider, if it serves that model.
    pub fn provider_target(&self, target: &str) -> Option<(&ProviderConfig, &str)> {
        let (provider, model) = target.split_once('/')?;
        let provider = self.provider(provider)?;
        let model = provider.models.iter().find(|m| *m == model)?;
        Some((provider, model.as_str()))
    }
}

/// A URL check without pulling an HTTP client into the core crate: scheme and host only.
fn reqwest_free_url_check(url: &str) -> Result<(), String> {
    let rest = url
        .strip_prefix("http://")
        .or_else(|| url.strip_prefix("https://"))
        .ok_or_else(|| format!("{url:?} must start with http:// or https://"))?;
    if rest.is_empty() || rest.starts_with('/') {
        return Err(format!("{url:?} has no host"));
    }
    Ok(())
}

impl KeyConfig {
    /// The key's secret, from `value` or the environment variable `env`.
    pub fn resolve(&self) -> Result<SecretString, String> {
        let aws = self.access_key_id.is_some()
            || self.access_key_id_env.is_some()
            || self.secret_access_key.is_some()
            || self.secret_access_key_env.is_some();
        match (&self.value, &self.env, &self.file, aws) {
            (Some(v), None, None, false) => Ok(v.clone()),
            (None, Some(var), None, false) => from_env(var, "env"),
            (None, None, Some(path), false) => std::fs::read_to_string(path)
                .map(SecretString::from)
                .map_err(|e| format!("the key file {path:?} (named by `file`) cannot be read: {e}")),
            (None, None, None, true) => {
                let id = match (&self.access_key_id, &self.access_key_id_env) {
                    (Some(id), None) => id.clone(),
                    (None, Some(var)) => from_env(var, "access_key_id_env")?.expose_secret().to_owned(),
                    _ => return Err("give `access_key_id` or `access_key_id_env`, one of them".to_owned()),
                };
                let secret = match (&self.secret_access_key, &self.secret_access_key_env) {
                    (Some(secret), None) => secret.clone(),
                    (None, Some(var)) => from_env(var, "secret_access_key_env")?,
                    _ => {
                        return Err(
                            "give `secret_access_key` or `secret_access_key_env`, one of them".to_owned()
                        );
                    }
                };
                let token = match (&self.session_token, &self.session_token_env) {
                    (Some(token), None) => Some(token.clone()),
                    (None, Some(var)) => Some(from_env(var, "session_token_env")?),
                    (None, None) => None,
                    _ => return Err("give `session_token` or `session_token_env`, not both".to_owned()),
                };
                let token = token.map_or(String::new(), |t| format!(":{}", t.expose_secret()));
                Ok(SecretString::from(format!(
                    "{id}:{}{token}",
                    secret.expose_secret()
                )))
            }
            (None, None, None, false) => {
                Err("needs `value`, `env`, `file`, or `access_key_id` and `secret_access_key`".to_owned())
            }
            _ => Err("give one of `value`, `env`, `file`, or the access key pair".to_owned()),
        }
    }
}

/// A secret from the environment variable `var`, named by the key's `field`.
fn from_env(var: &str, field: &str) -> Result<SecretString, String> {
    std::env::var(var)
        .map(SecretString::from)
        .map_err(|_| format!("environment variable {var} (named by `{field}`) is not set"))
}

/// What is wrong with a resolved key for a provider of `kind`, if anything: a Bedrock key
/// is `access_key_id:secret_access_key[:session_token]`, a Vertex key a service account's
/// JSON key.
/// The reason never quotes the secret.
pub fn key_fault(kind: ProviderKind, secret: &SecretString) -> Option<&'static str> {
    let secret = secret.expose_secret();
    match kind {
        ProviderKind::Bedrock => {
            let parts: Vec<&str> = secret.split(':').collect();
            (!(2..=3).contains(&parts.len()) || parts.iter().any(|p| p.is_empty())).then_some(
                "a bedrock key needs `access_key_id` and `secret_access_key` (or a `value` of `ID:SECRET[:SESSION_TOKEN]`)",
            )
        }
        ProviderKind::Vertex => {
            let json: Option<serde_json::Value> = serde_json::from_str(secret).ok();
            let field = |k: &str| {
                json.as_ref()
                    .and_then(|j| j.get(k))
                    .and_then(serde_json::Value::as_str)
                    .is_some_and(|v| !v.is_empty())
            };
            (!["client_email", "private_key", "token_uri"]
                .iter()
                .all(|k| field(k)))
            .then_some(
                "a vertex key is a service account's JSON key (with client_email, private_key and token_uri)",
            )
        }
        _ => None,
    }
}

/// Longest duration any `*_secs` / `*_ms` / `*_seconds` setting may give: ten years.
/// Beyond it, time arithmetic overflows (chrono panics), so such a value is refused when
/// the config is read, not met by a handler or a loop later.
pub const MAX_DURATION_SECS: u64 = 10 * 366 * 86_400;

/// Every duration in the config text, checked against [`MAX_DURATION_SECS`] by the
/// unit in its key's name, whatever table it is in (so a new duration field is covered).
fn check_durations(value: &toml::Value, at: &str) -> Result<(), ConfigError> {
    match value {
        toml::Value::Table(table) => {
            for (key, item) in table {
                let path = if at.is_empty() {
                    key.clone()
                } else {
                    format!("{at}.{key}")
                };
                let per_sec = if key.ends_with("_ms") {
                    Some(1000)
                } else if key.ends_with("_secs") || key.ends_with("_seconds") {
                    Some(1)
                } else {
                    None
                };
                let too_long = |n: f64, unit: u64| !(0.0..=(MAX_DURATION_SECS * unit) as f64).contains(&n);
                match (per_sec, item) {
                    (Some(unit), toml::Value::Integer(n)) if too_long(*n as f64, unit) => {
                        return Err(invalid(path, "must be from 0 to ten years"));
                    }
                    (Some(unit), toml::Value::Float(n)) if !n.is_finite() || too_long(*n, unit) => {
                        return Err(invalid(path, "must be from 0 to ten years"));
                    }
                    _ => check_durations(item, &path)?,
                }
            }
            Ok(())
        }
        toml::Value::Array(items) => items
            .iter()
            .enumerate()
            .try_for_each(|(i, item)| check_durations(item, &format!("{at}[{i}]"))),
        _ => Ok(()),
    }
}

/// Shortest API or admin key accepted when the server listens beyond loopback: a key
/// anybody on the network may try must not be guessable (24 random characters of base64
/// or hex are over 96 bits).
pub const MIN_KEY_CHARS: usize = 24;

impl ServerConfig {
    /// Every tenant's API rate, unless the tenant sets its own.
    pub fn api_rate(&self) -> ApiRate {
        ApiRate {
            per_sec: self.api_rate_per_sec,
            burst: self.api_burst,
        }
    }

    /// The admin key: `admin_key`, or the variable `admin_key_env` names; `None` when
    /// neither is given.
    pub fn admin_key(&self) -> Result<Option<SecretString>, String> {
        match (&self.admin_key, &self.admin_key_env) {
            (Some(key), None) => Ok(Some(key.clone())),
            (None, Some(var)) => std::env::var(var)
                .map(|k| Some(SecretString::from(k)))
                .map_err(|_| {
                    format!("environment variable {var} (named by `server.admin_key_env`) is not set")
                }),
            (Some(_), Some(_)) => Err("give `server.admin_key` or `server.admin_key_env`, not both".into()),
            (None, None) => Ok(None),
        }
    }

    /// Refuses a short key when `listen` is reachable from other hosts; on loopback only
    /// (the demo, the tests) a short key is allowed.
    fn check_key(&self, field: &str, key: &SecretString) -> Result<(), ConfigError> {
        if self.listen.ip().is_loopback() || key.expose_secret().chars().count() >= MIN_KEY_CHARS {
            return Ok(());
        }
        Err(invalid(
            field,
            format!(
                "shorter than {MIN_KEY_CHARS} characters, which a client on the network could guess, and server.listen ({}) is not loopback: use a random key (e.g. `openssl rand -hex 24`)",
                self.listen
            ),
        ))
    }
}

impl TenantConfig {
    /// The tenant's key in clear, when the config gives it (`api_key`, `api_key_env`);
    /// `None` with `api_key_sha256` or when the variable is unset.
    fn clear_key(&self) -> Option<SecretString> {
        match (&self.api_key, &self.api_key_env) {
            (Some(key), _) => Some(key.clone()),
            (None, Some(var)) => std::env::var(var).ok().map(SecretString::from),
            (None, None) => None,
        }
    }

    /// The SHA-256 of the tenant's API key: from `api_key_sha256`, or of the key in
    /// `api_key` / the variable `api_key_env`. Exactly one of the three is required.
    pub fn key_sha256(&self) -> Result<[u8; 32], String> {
        use sha2::{Digest, Sha256};
        let key = match (&self.api_key, &self.api_key_env, &self.api_key_sha256) {
            (Some(v), None, None) => v.clone(),
            (None, Some(var), None) => std::env::var(var)
                .map(SecretString::from)
                .map_err(|_| format!("environment variable {var} (named by `api_key_env`) is not set"))?,
            (None, None, Some(hex)) => return parse_sha256_hex(hex),
            (None, None, None) => return Err("needs `api_key`, `api_key_env` or `api_key_sha256`".to_owned()),
            _ => return Err("give one of `api_key`, `api_key_env`, `api_key_sha256`".to_owned()),
        };
        Ok(Sha256::digest(key.expose_secret().as_bytes()).into())
    }
}

/// The `[[tenants]]` field a tenant spec's `field` comes from (`limits.rpm` → `rpm`,
/// `budgets[1].usd` → that budget's `…_spend_usd`, `applications.bot.limits.rpm` →
/// `applications.bot.rpm`).
fn tenant_field(t: &TenantConfig, field: &str) -> String {
    let spec = t.spec();
    let (prefix, field, budgets) = match field.strip_prefix("applications.") {
        Some(rest) => {
            let (app, field) = rest.split_once('.').unwrap_or((rest, ""));
            let budgets = spec
                .applications
                .get(app)
                .map(|a| a.budgets.clone())
                .unwrap_or_default();
            (format!("applications.{app}."), field, budgets)
        }
        None => (String::new(), field, spec.budgets),
    };
    if let Some(rest) = field
        .strip_prefix("limits.")
        .or_else(|| field.strip_prefix("settings."))
    {
        return format!("{prefix}{rest}");
    }
    let budget = field
        .strip_prefix("budgets[")
        .and_then(|rest| rest.split(']').next())
        .and_then(|i| i.parse::<usize>().ok())
        .and_then(|i| budgets.get(i).copied());
    match budget {
        Some(b) => format!("{prefix}{}_usd", b.window.bucket_name()),
        None => format!("{prefix}{field}"),
    }
}

/// 64 hex digits → the 32 bytes of a SHA-256.
pub fn parse_sha256_hex(hex: &str) -> Result<[u8; 32], String> {
    let bad = || "`api_key_sha256` must be 64 hex digits (a SHA-256)".to_owned();
    if hex.len() != 64 || !hex.is_ascii() {
        return Err(bad());
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[[providers]]
name = "oai"
kind = "openai"
base_url = "http://127.0.0.1:18080/v1"
keys = [{ name = "k1", value = "sk-1" }]
models = ["gpt-4o-mini"]
[providers.limits."gpt-4o-mini"]
rpm = 600
tpm = 100000

[[routes]]
alias = "fast"
targets = ["oai/gpt-4o-mini"]

[[tenants]]
name = "acme"
api_key = "tk-acme"
weight = 3
"#;

    #[test]
    fn toml_errors_keep_their_line_and_caret() {
        let line_of = |text: &str, start: &str| text.lines().position(|l| l.starts_with(start)).unwrap() + 1;
        // Bad syntax.
        let text = GOOD.replace("rpm = 600", "rpm = = 600");
        let e = Config::parse(&text, "t.toml").unwrap_err().to_string();
        let line = line_of(&text, "rpm");
        assert!(
            e.starts_with(&format!("config t.toml: TOML parse error at line {line}, column")),
            "{e}"
        );
        assert!(e.contains(&format!("\n{line} | rpm = = 600\n")), "{e}");
        assert!(e.contains('^'), "{e}");
        // Good syntax, wrong type: pointed at too.
        let text = GOOD.replace("weight = 3", "weight = \"heavy\"");
        let e = Config::parse(&text, "t.toml").unwrap_err().to_string();
        let line = line_of(&text, "weight");
        assert!(
            e.contains(&format!("TOML parse error at line {line}, column")),
            "{e}"
        );
        assert!(e.contains(&format!("\n{line} | weight = \"heavy\"\n")), "{e}");
        assert!(e.contains('^'), "{e}");
    }

    fn err(text: &str) -> String {
        match Config::parse(text, "test.toml") {
            Ok(_) => panic!("config should have been rejected"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn a_pace_start_below_one_request_a_second_is_refused() {
        for value in ["0.5", "-3.0", "nan", "inf"] {
            let refused = err(&format!("[gate]\npace_start_rps = {value}\n{GOOD}"));
            assert!(refused.contains("gate.pace_start_rps"), "{value}: {refused}");
        }
    }

    #[test]
    fn durations_beyond_ten_years_and_odd_tenant_names_are_refused() {
        for line in [
            "[dispatch]\nlease_secs = 9223372036854775807",
            "[retry]\nmax_delay_ms = 400000000000000",
            "[classes.batch]\ndefault_deadline_secs = 999999999999",
            "[gate]\nheadroom_secs = 1e300",
            "[server]\nmax_wait_secs = -1",
        ] {
            let refused = err(&format!("{line}\n{GOOD}"));
            assert!(refused.contains("ten years"), "{line}: {refused}");
        }
        for name in ["a:b", "a/b", "", "tab\\t", &"x".repeat(65)] {
            let refused = err(&GOOD.replace("name = \"acme\"", &format!("name = \"{name}\"")));
            assert!(refused.contains("tenants[0].name"), "{name:?}: {refused}");
        }
    }

    #[test]
    fn a_tenant_s_applications_are_read_and_checked_by_the_file_s_names() {
        let text = format!("{GOOD}[tenants.applications.chatbot]\nrpm = 60\ndaily_spend_usd = 5\n");
        let config = Config::parse(&text, "t.toml").unwrap();
        let spec = config.tenants[0].spec();
        let chatbot = &spec.applications["chatbot"];
        assert_eq!(chatbot.limits.rpm, Some(60));
        assert_eq!(
            chatbot.budgets,
            [Budget {
                window: BudgetWindow::Day,
                usd: 5.0
            }]
        );
        let refused = err(&text.replace("daily_spend_usd = 5", "daily_spend_usd = -5"));
        assert!(
            refused.contains("tenants[0].applications.chatbot.daily_spend_usd"),
            "{refused}"
        );
        let refused = err(&text.replace("rpm = 60\n", "rpm = 0\n"));
        assert!(
            refused.contains("tenants[0].applications.chatbot.rpm"),
            "{refused}"
        );
    }

    #[test]
    fn short_keys_are_refused_beyond_loopback() {
        let public = format!("[server]\nlisten = \"0.0.0.0:8080\"\n{GOOD}");
        let refused = err(&public);
        assert!(
            refused.contains("tenants[0].api_key`: shorter than 24"),
            "{refused}"
        );
        let admin = format!(
            "[server]\nlisten = \"0.0.0.0:8080\"\nadmin_key = \"tk-admin\"\n{}",
            GOOD.replace("tk-acme", "acme-0123456789abcdef01234567")
        );
        let refused = err(&admin);
        assert!(
            refused.contains("server.admin_key`: shorter than 24"),
            "{refused}"
        );
        let strong = admin.replace("tk-admin", "admin-0123456789abcdef01234567");
        assert!(Config::parse(&strong, "test.toml").is_ok());
        // On loopback (the demo, the tests) a short key is fine.
        assert!(Config::parse(GOOD, "test.toml").is_ok());
    }

    #[test]
    fn accepts_the_documented_shape() {
        let c = Config::parse(GOOD, "test.toml").unwrap();
        assert_eq!(c.providers[0].limits["gpt-4o-mini"].rpm, Some(600));
        assert_eq!(c.tenants[0].weight, 3);
        assert_eq!(c.dispatch.lease_secs, 30);
        let (p, m) = c.provider_target("oai/gpt-4o-mini").unwrap();
        assert_eq!((p.name.as_str(), m), ("oai", "gpt-4o-mini"));
        assert!(c.provider_target("oai/gpt-5").is_none());
    }

    #[test]
    fn quotas_have_defaults() {
        let c = Config::parse(GOOD, "test.toml").unwrap();
        let defaults = Quotas::default();
        assert_eq!(c.quotas, defaults);
        assert_eq!(
            (defaults.max_files, defaults.max_stored_file_bytes),
            (10_000, 10 << 30)
        );
        assert!(err(&format!("{GOOD}[quotas]\nmax_bytes = 1\n")).contains("max_bytes"));
    }

    #[test]
    fn gemini_and_azure_kinds_default_their_dialects() {
        let c = Config::parse(&GOOD.replace("kind = \"openai\"", "kind = \"gemini\""), "t").unwrap();
        assert_eq!(c.providers[0].kind, ProviderKind::Gemini);
        assert_eq!(c.providers[0].dialect(), Dialect::Gemini);
        let c = Config::parse(&GOOD.replace("kind = \"openai\"", "kind = \"azure\""), "t").unwrap();
        assert_eq!(c.providers[0].dialect(), Dialect::Azure);
        assert_eq!(c.providers[0].azure_api_version, "2024-10-21");
    }

    /// Bedrock and Vertex: their endpoints from the region and location, their keys (an
    /// access key pair; a service account's JSON key, read from a file), and what each
    /// needs refused by its field.
    #[test]
    fn bedrock_and_vertex_take_their_own_keys_and_places() {
        let bedrock = r#"
[[providers]]
name = "bed"
kind = "bedrock"
region = "eu-central-1"
keys = [{ name = "a", access_key_id = "AKID1", secret_access_key = "s3cret" }]
models = ["anthropic.claude-3-5-haiku-20241022-v1:0"]
[[tenants]]
name = "t"
api_key = "tk-test"
"#;
        let c = Config::parse(bedrock, "t").unwrap();
        let p = &c.providers[0];
        assert_eq!(p.base_url, "https://bedrock-runtime.eu-central-1.amazonaws.com");
        assert_eq!(p.dialect(), Dialect::None);
        assert_eq!(p.keys[0].resolve().unwrap().expose_secret(), "AKID1:s3cret");
        let temporary = bedrock.replace(
            "secret_access_key = \"s3cret\"",
            "secret_access_key = \"s3cret\", session_token = \"tok\"",
        );
        let c = Config::parse(&temporary, "t").unwrap();
        assert_eq!(
            c.providers[0].keys[0].resolve().unwrap().expose_secret(),
            "AKID1:s3cret:tok"
        );
        assert!(err(&bedrock.replace("region = \"eu-central-1\"\n", "")).contains("providers[0].region"));
        let half = bedrock.replace(", secret_access_key = \"s3cret\"", "");
        assert!(err(&half).contains("secret_access_key"), "{}", err(&half));
        let plain = bedrock.replace(
            "access_key_id = \"AKID1\", secret_access_key = \"s3cret\"",
            "value = \"no-pair\"",
        );
        assert!(err(&plain).contains("providers[0].keys[0]"), "{}", err(&plain));

        let dir = tempfile::tempdir().unwrap();
        let key_file = dir.path().join("sa.json");
        std::fs::write(
            &key_file,
            r#"{"type":"service_account","client_email":"a@p.iam.gserviceaccount.com","private_key":"-----BEGIN PRIVATE KEY-----\n","token_uri":"https://oauth2.googleapis.com/token"}"#,
        )
        .unwrap();
        let vertex = format!(
            r#"
[[providers]]
name = "vx"
kind = "vertex"
project = "acme-prod"
location = "global"
keys = [{{ name = "sa", file = "{}" }}]
models = ["gemini-2.0-flash"]
[[tenants]]
name = "t"
api_key = "tk-test"
"#,
            key_file.display()
        );
        let c = Config::parse(&vertex, "t").unwrap();
        assert_eq!(c.providers[0].base_url, "https://aiplatform.googleapis.com");
        assert_eq!(c.providers[0].dialect(), Dialect::Gemini);
        let regional = Config::parse(&vertex.replace("\"global\"", "\"us-central1\""), "t").unwrap();
        assert_eq!(
            regional.providers[0].base_url,
            "https://us-central1-aiplatform.googleapis.com"
        );
        assert!(err(&vertex.replace("project = \"acme-prod\"\n", "")).contains("providers[0].project"));
        std::fs::write(&key_file, "sk-not-a-service-account").unwrap();
        let e = err(&vertex);
        assert!(e.contains("service account") && !e.contains("sk-not"), "{e}");
        std::fs::remove_file(&key_file).unwrap();
        assert!(err(&vertex).contains("cannot be read"));
    }

    #[test]
    fn errors_name_the_field() {
        let e = err(&GOOD.replace("oai/gpt-4o-mini\"]", "oai/nope\"]"));
        assert!(e.contains("routes[0].targets[0]"), "{e}");
        let e = err(&GOOD.replace("{ name = \"k1\", value = \"sk-1\" }", "{ name = \"k1\" }"));
        assert!(e.contains("providers[0].keys[0]"), "{e}");
        let e = err(&GOOD.replace(
            "{ name = \"k1\", value = \"sk-1\" }",
            "{ name = \"k1\", value = \"sk-1\", account = \"org:a\" }",
        ));
        assert!(e.contains("providers[0].keys[0].account"), "{e}");
        let e = err(&GOOD.replace("kind = \"openai\"", "kind = \"cohere\""));
        assert!(e.contains("kind") && e.contains("test.toml"), "{e}");
        let e = err(&GOOD.replace("weight = 3", "weight = 0"));
        assert!(e.contains("tenants[0].weight"), "{e}");
        let e = err(&GOOD.replace("weight = 3", "api_rate_per_sec = 0.0"));
        assert!(e.contains("tenants[0].api_rate_per_sec"), "{e}");
        let e = err(&GOOD.replace("weight = 3", "api_burst = 0.5"));
        assert!(e.contains("tenants[0].api_burst"), "{e}");
        let e = err(&GOOD.replace("http://127", "ftp://127"));
        assert!(e.contains("providers[0].base_url"), "{e}");
        let e = err(&format!("{GOOD}\nunknown_field = 1"));
        assert!(e.contains("unknown_field"), "{e}");
        let e = err(&GOOD.replace(
            "api_key = \"tk-acme\"",
            "api_key_env = \"TOLLGATE_TEST_UNSET_VAR\"",
        ));
        assert!(e.contains("TOLLGATE_TEST_UNSET_VAR"), "{e}");
    }
}
