//! Provider adapters: one OpenAI-format request in, one OpenAI-format response (or a
//! classified [`Failure`]) out. Adapters never retry — retrying is the dispatcher's call.
//!
//! - [`openai`]: OpenAI Chat Completions and every OpenAI-compatible server.
//! - [`anthropic`]: Anthropic Messages, translated to and from the OpenAI chat format.
//! - [`gemini`]: Google Gemini `generateContent`, translated to and from the OpenAI chat format.
//! - [`batch_api`]: the providers' own batch APIs (OpenAI Batch, Anthropic Message Batches).
//! - [`azure`]: Azure OpenAI deployments: OpenAI's format at Azure's URL and auth header.

pub mod anthropic;
pub mod azure;
pub mod batch_api;
pub mod gemini;
pub mod openai;
pub mod streaming;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use reqwest::header::HeaderMap;
use secrecy::SecretString;
use serde_json::{Map, Value};
use tollgate::config::{Config, ProviderConfig, ProviderKind};
use tollgate::model::Usage;
use tollgate::ratelimit::{self, Dialect, Signals};
use tollgate::retry::{Failure, classify_response};
use tollgate::routing::Target;

/// A provider key; the secret is never logged, serialized or returned.
pub struct ProviderKey {
    pub name: String,
    secret: SecretString,
    /// Models this key may serve; empty = all.
    models: Vec<String>,
}

impl ProviderKey {
    fn serves(&self, model: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|m| m == model)
    }
}

/// One configured provider with its keys.
pub struct ProviderClient {
    pub name: String,
    pub kind: ProviderKind,
    base_url: String,
    anthropic_version: String,
    azure_api_version: String,
    dialect: Dialect,
    keys: Vec<ProviderKey>,
    next_key: AtomicUsize,
}

/// A successful call, already in OpenAI chat format.
#[derive(Debug, Clone)]
pub struct Success {
    pub body: Value,
    pub usage: Usage,
}

/// What one provider call came to, with what the record of the attempt needs.
#[derive(Debug)]
pub struct CallOutcome {
    pub key_name: String,
    pub status: Option<u16>,
    pub request_id: Option<String>,
    /// The rate-limit headers as sent (names lower-case), for the attempt record.
    pub rate_limit: Option<Value>,
    /// What the response said about the provider's limits, parsed.
    pub signals: Signals,
    pub result: Result<Success, Failure>,
}

#[derive(Debug, thiserror::Error)]
pub enum ProviderSetupError {
    #[error("provider {provider}: key {key}: {reason}")]
    Key {
        provider: String,
        key: String,
        reason: String,
    },
    #[error("HTTP client: {0}")]
    Http(#[from] reqwest::Error),
}

/// Every configured provider, sharing one pooled HTTP client.
#[derive(Clone)]
pub struct Providers {
    http: reqwest::Client,
    by_name: Arc<HashMap<String, ProviderClient>>,
}

impl Providers {
    pub fn from_config(config: &Config) -> Result<Self, ProviderSetupError> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(config.dispatch.request_timeout_secs))
            .connect_timeout(Duration::from_secs(10))
            .pool_max_idle_per_host(config.dispatch.concurrency.max(8))
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        let mut by_name = HashMap::new();
        for p in &config.providers {
            by_name.insert(p.name.clone(), ProviderClient::new(p)?);
        }
        Ok(Self {
            http,
            by_name: Arc::new(by_name),
        })
    }

    pub fn get(&self, name: &str) -> Option<&ProviderClient> {
        self.by_name.get(name)
    }

    /// Sends `request` (OpenAI chat format) to `target` with the provider's next key.
    pub async fn call(&self, target: &Target, request: &Value) -> CallOutcome {
        let Some(client) = self.get(&target.provider) else {
            return CallOutcome::refused(Failure {
                class: tollgate::retry::FailureClass::Request,
                code: "unknown_provider",
                message: format!("provider {:?} is not configured", target.provider),
                status: None,
                retry_after: None,
            });
        };
        client.call(&self.http, target, request).await
    }
}

impl ProviderClient {
    fn new(p: &ProviderConfig) -> Result<Self, ProviderSetupError> {
        let keys = p
            .keys
            .iter()
            .map(|k| {
                k.resolve()
                    .map(|secret| ProviderKey {
                        name: k.name.clone(),
                        secret,
                        models: k.models.clone(),
                    })
                    .map_err(|reason| ProviderSetupError::Key {
                        provider: p.name.clone(),
                        key: k.name.clone(),
                        reason,
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            name: p.name.clone(),
            kind: p.kind,
            base_url: p.base_url.trim_end_matches('/').to_owned(),
            anthropic_version: p.anthropic_version.clone(),
            azure_api_version: p.azure_api_version.clone(),
            dialect: p.dialect(),
            keys,
            next_key: AtomicUsize::new(0),
        })
    }

    /// The key the gate chose for `target`, else round robin over the keys that serve its
    /// model.
    fn pick_key(&self, target: &Target) -> &ProviderKey {
        if let Some(key) = target
            .key
            .as_ref()
            .and_then(|name| self.keys.iter().find(|k| &k.name == name))
        {
            return key;
        }
        let serving: Vec<&ProviderKey> = self.keys.iter().filter(|k| k.serves(&target.model)).collect();
        let pool = if serving.is_empty() {
            self.keys.iter().collect()
        } else {
            serving
        };
        let i = self.next_key.fetch_add(1, Ordering::Relaxed) % pool.len().max(1);
        pool[i]
    }

    async fn call(&self, http: &reqwest::Client, target: &Target, request: &Value) -> CallOutcome {
        let key = self.pick_key(target);
        let model = target.model.as_str();
        let built = match self.kind {
            ProviderKind::Openai | ProviderKind::OpenaiCompatible => {
                openai::build(http, &self.base_url, &key.secret, model, request)
            }
            ProviderKind::Anthropic => anthropic::build(
                http,
                &self.base_url,
                &key.secret,
                &self.anthropic_version,
                model,
                request,
            ),
            ProviderKind::Gemini => gemini::build(http, &self.base_url, &key.secret, model, request),
            ProviderKind::Azure => azure::build(
                http,
                &self.base_url,
                &key.secret,
                &self.azure_api_version,
                model,
                request,
            ),
        };
        let mut outcome = CallOutcome {
            key_name: key.name.clone(),
            status: None,
            request_id: None,
            rate_limit: None,
            signals: Signals::default(),
            result: Err(Failure::network("request was not sent")),
        };
        let response = match built.send().await {
            Ok(r) => r,
            Err(e) => {
                outcome.result = Err(send_failure(e));
                return outcome;
            }
        };
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        outcome.status = Some(status);
        outcome.request_id = request_id(&headers);
        outcome.rate_limit = rate_limit_headers(&headers);
        let body = match response.bytes().await {
            Ok(b) => b,
            Err(e) => {
                outcome.result = Err(send_failure(e));
                return outcome;
            }
        };
        let success = (200..300).contains(&status);
        // Only error bodies carry limits (Gemini's quota, OpenAI's "Limit N").
        let error_body: &[u8] = if success { b"" } else { &body };
        outcome.signals = ratelimit::read(self.dialect, &headers, error_body, chrono::Utc::now());
        outcome.result = if success {
            let parsed = match self.kind {
                ProviderKind::Openai | ProviderKind::OpenaiCompatible | ProviderKind::Azure => {
                    openai::parse_success(&body)
                }
                ProviderKind::Gemini => gemini::parse_success(&body, model),
                ProviderKind::Anthropic => anthropic::parse_success(&body),
            };
            parsed
                .map(|s| self.with_usage(s, model, request))
                .map_err(|reason| Failure::bad_response(reason, status))
        } else {
            Err(classify_response(status, &headers, &body))
        };
        outcome
    }
}

impl ProviderClient {
    /// A success whose body has no `usage` (a provider or proxy fault) is settled with
    /// the request's estimate — input by the tokenizer or char rule, output at its cap —
    /// so its reservation is kept whole rather than refunded as if nothing was used; the
    /// result says so in `usage.tollgate_estimated`.
    fn with_usage(&self, mut success: Success, model: &str, request: &Value) -> Success {
        if success.body.get("usage").is_some_and(Value::is_object) {
            return success;
        }
        let input = i64::from(tollgate::estimate::input_tokens(request, Some(model)));
        let output = i64::from(tollgate::estimate::output_tokens(request));
        tracing::warn!(provider = %self.name, model, "provider answered without usage; settling with the estimate");
        tollgate::metrics::usage_missing(&self.name, model);
        success.usage = Usage {
            input_tokens: input,
            output_tokens: output,
            cached_tokens: 0,
        };
        if let Some(obj) = success.body.as_object_mut() {
            obj.insert(
                "usage".to_owned(),
                serde_json::json!({
                    "prompt_tokens": input,
                    "completion_tokens": output,
                    "total_tokens": input + output,
                    "tollgate_estimated": true,
                }),
            );
        }
        success
    }
}

/// Removes the `usage` a translation filled with zeros when the provider sent none.
pub(crate) fn drop_usage(body: &mut Value) {
    if let Some(obj) = body.as_object_mut() {
        obj.remove("usage");
    }
}

impl CallOutcome {
    /// A call refused before anything was sent.
    fn refused(failure: Failure) -> Self {
        Self {
            key_name: String::new(),
            status: None,
            request_id: None,
            rate_limit: None,
            signals: Signals::default(),
            result: Err(failure),
        }
    }
}

fn send_failure(e: reqwest::Error) -> Failure {
    // reqwest's Display of a send error can include the URL but never headers or keys.
    let timed_out = e.is_timeout();
    let message = format!("{}", e.without_url());
    if timed_out {
        Failure::timeout(message)
    } else {
        Failure::network(message)
    }
}

fn request_id(headers: &HeaderMap) -> Option<String> {
    ["x-request-id", "request-id"]
        .iter()
        .find_map(|h| headers.get(*h))
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// Keeps the headers that carry rate-limit state, for the attempt record.
fn rate_limit_headers(headers: &HeaderMap) -> Option<Value> {
    let mut map = Map::new();
    for (name, value) in headers {
        let n = name.as_str();
        let keep = n.starts_with("x-ratelimit-")
            || n.starts_with("anthropic-ratelimit-")
            || n.starts_with("x-tokenlimit-")
            || n == "retry-after"
            || n == "retry-after-ms";
        if keep && let Ok(v) = value.to_str() {
            map.insert(n.to_owned(), Value::String(v.to_owned()));
        }
    }
    (!map.is_empty()).then_some(Value::Object(map))
}

/// Reads an integer field of a usage object, 0 when absent.
pub(crate) fn int(v: &Value, path: &[&str]) -> i64 {
    path.iter()
        .try_fold(v, |v, k| v.get(*k))
        .and_then(Value::as_i64)
        .unwrap_or(0)
}
