//! Provider adapters: one OpenAI-format request in, one OpenAI-format response (or a
//! classified [`Failure`]) out. Adapters never retry — retrying is the dispatcher's call.
//!
//! This module owns everything that differs between providers, behind one trait,
//! [`ProviderApi`]: the request (URL, auth headers, body; plain and streamed), reading a
//! success into OpenAI chat-completion format with its usage, translating stream events
//! into OpenAI chunks ([`streaming::StreamEvents`]), classifying an error answer into the
//! retry taxonomy, reading rate-limit signals, and the provider's own batch API where it
//! has one ([`batch_api::BatchApi`]). What is the same for every provider lives here once:
//! key selection, the one send path of plain and streamed calls (HTTP send, timeouts,
//! header reading, error classification) and the usage fallback.
//!
//! - [`openai`]: OpenAI Chat Completions, Files and Batch, and every OpenAI-compatible server.
//! - [`anthropic`]: Anthropic Messages (requests, responses and stream events translated
//!   to and from the OpenAI chat format) and Message Batches.
//! - [`gemini`]: Google Gemini `generateContent`, translated to and from the OpenAI chat format.
//! - [`as_chat`]: endpoints a target does not speak sent to it as chat: Anthropic Messages
//!   ([`messages_chat`]) and OpenAI Responses ([`responses_chat`]).
//! - [`azure`]: Azure OpenAI deployments: OpenAI's format at Azure's URL and auth header.
//! - [`bedrock`]: AWS Bedrock's Converse and ConverseStream, SigV4-signed, translated to
//!   and from the OpenAI chat format; [`aws_events`] reads its binary event stream.
//! - [`vertex`]: Google Vertex AI, Gemini and Anthropic models, with OAuth2 tokens from a
//!   service-account key.
//! - [`streaming`]: [`streaming::ChatStream`], a started stream read event by event.
//! - [`sse`]: the `text/event-stream` parser the streams share.
//! - [`batch_api`]: [`batch_api::BatchClient`], the HTTP side of the providers' batch APIs.
//!
//! Adding a provider is one file and one line: implement [`ProviderApi`] in
//! `providers/<name>.rs` (and [`batch_api::BatchApi`] if it has a batch API), then map its
//! `ProviderKind` in `adapter` (below):
//!
//! ```ignore
//! ProviderKind::Acme => Box::new(acme::Acme::from_config(p)),
//! ```

pub mod anthropic;
pub mod as_chat;
pub mod aws_events;
pub mod azure;
pub mod batch_api;
pub mod bedrock;
pub mod gemini;
pub mod gemini_batch;
pub mod messages_chat;
pub mod openai;
pub mod responses_chat;
pub mod sse;
pub mod streaming;
pub mod vertex;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::future::BoxFuture;
use reqwest::RequestBuilder;
use reqwest::header::{ACCEPT, HeaderMap};
use secrecy::SecretString;
use serde_json::{Map, Value};
use tollgate::attempt::MAX_USAGE_TOKENS;
use tollgate::config::{Config, ProviderConfig, ProviderKind};
use tollgate::model::Usage;
use tollgate::ratelimit::{self, Signals};
use tollgate::retry::{Failure, FailureClass, classify_response};
use tollgate::routing::Target;
use tollgate::vocab::ReasonCode;
use tollgate::vocab::{Dialect, Endpoint};

use as_chat::AsChat;
use batch_api::BatchApi;
use streaming::StreamEvents;

/// How the answer to a call is read: whole, or as a stream of server-sent events.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Whole,
    Stream,
}

/// One provider's API as tollgate uses it. Each implementation lives in its own file and
/// holds what it needs from the provider's config (base URL, API versions). The methods
/// do no I/O — the send path in this module does — so the adapters are tested without
/// HTTP, on literal bodies.
pub trait ProviderApi: Send + Sync {
    /// The URL a call of `endpoint` served by `model` is posted to. An adapter is given
    /// only the endpoints its provider kind serves (`ProviderKind::serves`: routing keeps
    /// the others from it).
    fn url(&self, model: &str, endpoint: Endpoint, mode: Mode) -> String;

    /// Adds the key, and any header the API requires on every request, to `request`.
    /// Batch API requests are authorized the same way.
    fn authorize(&self, request: RequestBuilder, key: &SecretString) -> RequestBuilder;

    /// What a call is authorized with, given the configured `key`: the key itself, unless
    /// the provider exchanges it for a short-lived token first (Vertex AI's OAuth2). A key
    /// that cannot be exchanged is the call's failure.
    fn credential<'a>(
        &'a self,
        _http: &'a reqwest::Client,
        key: &'a SecretString,
    ) -> BoxFuture<'a, Result<SecretString, Failure>> {
        Box::pin(std::future::ready(Ok(key.clone())))
    }

    /// The provider's body for `request` (in `endpoint`'s shape) served by `model`.
    fn body(&self, model: &str, endpoint: Endpoint, request: &Value, mode: Mode) -> Value;

    /// A 2xx body as the answer of `endpoint` in its shape (a chat completion, an embeddings
    /// list, a response, an Anthropic message) with its usage; `Err` (why) when the body is not an answer. A body without usage
    /// comes back without `usage`, so that the send path settles it with the estimate
    /// instead of zeros.
    fn parse_success(&self, body: &[u8], endpoint: Endpoint, model: &str) -> Result<Success, String>;

    /// A fresh reader of this provider's stream events for a request of `endpoint` served by
    /// `model` (for chunks that name it when the events do not): a
    /// translator into OpenAI chunks for chat, Anthropic's events as they are for Messages;
    /// `None` when tollgate does not stream from this provider.
    fn stream_events(&self, endpoint: Endpoint, model: &str) -> Option<Box<dyn StreamEvents>>;

    /// A non-2xx answer, classified into the retry taxonomy. The shared classifier reads
    /// every provider's error shapes (OpenAI's codes, Anthropic's spend cap, Google's
    /// `API_KEY_INVALID`); an adapter overrides this only for what it alone sends.
    fn classify_error(&self, status: u16, headers: &HeaderMap, body: &[u8]) -> Failure {
        classify_response(status, headers, body)
    }

    /// What an answer says about the provider's limits. The dialect is the configured one
    /// (`providers[].dialect`, by kind unless set), because OpenAI-compatible servers
    /// (Groq, Mistral, Together) share a kind but not their headers' meaning.
    /// `error_body` is empty for a 2xx: only error bodies carry limits (Gemini's quota,
    /// OpenAI's "Limit N").
    fn signals(
        &self,
        dialect: Dialect,
        headers: &HeaderMap,
        error_body: &[u8],
        now: DateTime<Utc>,
    ) -> Signals {
        ratelimit::read(dialect, headers, error_body, now)
    }

    /// Whether a response header (name lower-case) carries rate-limit state worth keeping
    /// in the attempt record.
    fn keeps_header(&self, name: &str) -> bool {
        rate_limit_header(name)
    }

    /// The provider's own batch API, if tollgate drives one for it.
    fn batch(&self) -> Option<&dyn BatchApi> {
        None
    }

    /// The first field of `request` (OpenAI chat) this adapter cannot express to its
    /// provider's `model`, so that the request is refused before it becomes a job rather than sent
    /// without it. The OpenAI family sends the request as it is: nothing.
    fn unexpressed(&self, _model: &str, _request: &Value) -> Option<Unexpressed> {
        None
    }

    /// The request of one call: URL, auth and body together (a stream's accepting
    /// server-sent events).
    fn request(
        &self,
        http: &reqwest::Client,
        key: &SecretString,
        model: &str,
        endpoint: Endpoint,
        request: &Value,
        mode: Mode,
    ) -> RequestBuilder {
        let builder = self
            .authorize(http.post(self.url(model, endpoint, mode)), key)
            .json(&self.body(model, endpoint, request, mode));
        match mode {
            Mode::Whole => builder,
            Mode::Stream => builder.header(ACCEPT, "text/event-stream"),
        }
    }
}

/// The adapter of a configured provider: the one place a [`ProviderKind`] is mapped to
/// code, one line per provider.
pub(crate) fn adapter(p: &ProviderConfig) -> Box<dyn ProviderApi> {
    match p.kind {
        ProviderKind::Openai | ProviderKind::OpenaiCompatible => Box::new(openai::OpenAi::from_config(p)),
        ProviderKind::Anthropic => Box::new(anthropic::Anthropic::from_config(p)),
        ProviderKind::Gemini => Box::new(gemini::Gemini::from_config(p)),
        ProviderKind::Azure => Box::new(azure::Azure::from_config(p)),
        ProviderKind::Bedrock => Box::new(bedrock::Bedrock::from_config(p)),
        ProviderKind::Vertex => Box::new(vertex::Vertex::from_config(p)),
    }
}

/// A field of a chat request a provider's adapter cannot translate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unexpressed {
    /// The field, relative to the request (`response_format`, `messages[2].tool_calls`).
    pub param: String,
    pub message: String,
}

impl Unexpressed {
    fn at(param: String, message: impl Into<String>) -> Option<Self> {
        Some(Self {
            param,
            message: message.into(),
        })
    }
}

/// A `data:` URL's media type and base64 data.
fn data_url(url: &str) -> Option<(&str, &str)> {
    let (head, data) = url.strip_prefix("data:")?.split_once(',')?;
    Some((head.strip_suffix(";base64")?, data))
}

/// A chat tool call's arguments as the JSON object they encode (`None` when they are not
/// one).
fn arguments_object(call: &Value) -> Option<Value> {
    call.pointer("/function/arguments")
        .and_then(Value::as_str)
        .and_then(|a| serde_json::from_str::<Value>(a).ok())
        .filter(Value::is_object)
}

/// The array at `key` of `v`, or none.
fn array<'a>(v: &'a Value, key: &str) -> &'a [Value] {
    v.get(key)
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default()
}

/// What of `request` (OpenAI chat) the adapter of `provider` cannot express to `model`,
/// if anything.
pub fn unexpressed(provider: &ProviderConfig, model: &str, request: &Value) -> Option<Unexpressed> {
    adapter(provider).unexpressed(model, request)
}

/// The first of `fields` that `request` sets to more than its default (absent, null,
/// `false`, 0; `n`: 1; `response_format`: `{"type": "text"}`), as refused by `provider`.
fn first_set(request: &Value, fields: &[&str], provider: &str) -> Option<Unexpressed> {
    let set = |field: &str, v: &Value| match (field, v) {
        (_, Value::Null | Value::Bool(false)) => false,
        ("n", v) => v.as_i64() != Some(1),
        ("response_format", v) => v.get("type").and_then(Value::as_str) != Some("text"),
        (_, v) => v.as_f64() != Some(0.0),
    };
    let field = fields
        .iter()
        .find(|f| request.get(**f).is_some_and(|v| set(f, v)))?;
    Unexpressed::at(
        (*field).to_owned(),
        format!("`{field}` cannot be expressed to {provider}{ROUTE_ELSEWHERE}"),
    )
}

/// What a provider with function tools and no switch for one call at a time cannot
/// express of `request`: the first of `fields` set, `parallel_tool_calls: false`, and what
/// [`functions_only`] refuses.
fn chat_refusals(request: &Value, fields: &[&str], provider: &str) -> Option<Unexpressed> {
    if let Some(refused) = first_set(request, fields, provider) {
        return Some(refused);
    }
    if request.get("parallel_tool_calls") == Some(&Value::Bool(false)) {
        return Unexpressed::at(
            "parallel_tool_calls".to_owned(),
            format!("{provider} cannot be told to call one tool at a time{ROUTE_ELSEWHERE}"),
        );
    }
    functions_only(request, provider)
}

/// The first content part of `request` that is neither text nor an image given inline (a
/// `data:` URL) of a media type `accepts`, refused for `provider` with `images` saying
/// which images it takes.
fn text_and_inline_images(
    request: &Value,
    provider: &str,
    accepts: fn(&str) -> bool,
    images: &str,
) -> Option<Unexpressed> {
    for (i, m) in array(request, "messages").iter().enumerate() {
        for (j, part) in array(m, "content").iter().enumerate() {
            match part.get("type").and_then(Value::as_str) {
                Some("text") => {}
                Some("image_url") => {
                    let url = part.pointer("/image_url/url").and_then(Value::as_str);
                    if !url.and_then(data_url).is_some_and(|(media, _)| accepts(media)) {
                        return Unexpressed::at(
                            format!("messages[{i}].content[{j}].image_url.url"),
                            format!("{provider} takes images inline: {images}{ROUTE_ELSEWHERE}"),
                        );
                    }
                }
                _ => {
                    return Unexpressed::at(
                        format!("messages[{i}].content[{j}]"),
                        format!("tollgate sends {provider} text and image parts only{ROUTE_ELSEWHERE}"),
                    );
                }
            }
        }
    }
    None
}

/// What a refusal suggests.
const ROUTE_ELSEWHERE: &str = "; remove it or route to an OpenAI model";

/// The first tool of `request` that is not a function, or tool call whose arguments are
/// not a JSON object, refused for `provider`, whose tools are functions taking objects.
fn functions_only(request: &Value, provider: &str) -> Option<Unexpressed> {
    for (i, tool) in array(request, "tools").iter().enumerate() {
        if tool.get("type").and_then(Value::as_str) != Some("function") {
            return Unexpressed::at(
                format!("tools[{i}].type"),
                format!("{provider} takes function tools only{ROUTE_ELSEWHERE}"),
            );
        }
    }
    for (i, m) in array(request, "messages").iter().enumerate() {
        for (j, call) in array(m, "tool_calls").iter().enumerate() {
            let arguments = call
                .pointer("/function/arguments")
                .and_then(Value::as_str)
                .unwrap_or_default();
            if arguments_object(call).is_none() && !arguments.trim().is_empty() {
                return Unexpressed::at(
                    format!("messages[{i}].tool_calls[{j}].function.arguments"),
                    format!("tool call arguments must be a JSON object for {provider}{ROUTE_ELSEWHERE}"),
                );
            }
        }
    }
    None
}

/// The provider's base URL as configured, without a trailing `/`.
fn base_url(p: &ProviderConfig) -> String {
    p.base_url.trim_end_matches('/').to_owned()
}

/// The rate-limit headers of the OpenAI family (`x-ratelimit-*`, Together's
/// `x-tokenlimit-*`) and the `retry-after` pair every provider may send.
fn rate_limit_header(name: &str) -> bool {
    name.starts_with("x-ratelimit-")
        || name.starts_with("x-tokenlimit-")
        || name == "retry-after"
        || name == "retry-after-ms"
}

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

/// The key a call is sent with.
struct ChosenKey {
    name: String,
    secret: SecretString,
}

/// One configured provider with its keys: the file's, and through the control plane those
/// added at runtime, less those disabled.
pub struct ProviderClient {
    pub name: String,
    pub kind: ProviderKind,
    api: Box<dyn ProviderApi>,
    dialect: Dialect,
    keys: Vec<ProviderKey>,
    next_key: AtomicUsize,
    control: Control,
}

/// The control plane's keys, once the broker has it (else the file's keys alone).
type Control = Arc<std::sync::OnceLock<tollgate::control::Directory>>;

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
    /// The request may have reached the provider: false only when it was refused before
    /// sending or no connection was made.
    pub reached: bool,
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
    control: Control,
}

impl Providers {
    pub fn from_config(config: &Config) -> Result<Self, ProviderSetupError> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(config.dispatch.request_timeout_secs))
            .connect_timeout(Duration::from_secs(10))
            .pool_max_idle_per_host(config.dispatch.concurrency.max(8))
            .redirect(reqwest::redirect::Policy::none())
            .build()?;
        let control = Control::default();
        let mut by_name = HashMap::new();
        for p in &config.providers {
            by_name.insert(p.name.clone(), ProviderClient::new(p, control.clone())?);
        }
        Ok(Self {
            http,
            by_name: Arc::new(by_name),
            control,
        })
    }

    /// Sends with the keys of `directory`'s control plane too: those added at runtime, and
    /// not those disabled. Set once; a later call changes nothing.
    pub fn with_control(self, directory: tollgate::control::Directory) -> Self {
        let _ = self.control.set(directory);
        self
    }

    /// The provider keys of the control plane now (empty until [`Providers::with_control`]).
    pub fn keyring(&self) -> Arc<tollgate::keyring::Keyring> {
        self.control.get().map(|d| d.keyring()).unwrap_or_default()
    }

    pub fn get(&self, name: &str) -> Option<&ProviderClient> {
        self.by_name.get(name)
    }

    /// Sends `request` (in `endpoint`'s shape) to `target` with the provider's next key.
    /// A request of an endpoint the target does not speak goes as chat, and its answer
    /// comes back in the endpoint's shape ([`as_chat`]).
    pub async fn call(&self, target: &Target, endpoint: Endpoint, request: &Value) -> CallOutcome {
        let client = match self.client(target) {
            Ok(client) => client,
            Err(unknown) => return CallOutcome::refused(unknown),
        };
        let Some(as_chat) = AsChat::of(target.kind, endpoint) else {
            return client.call(&self.http, target, endpoint, request).await;
        };
        let chat = as_chat.chat_request(request);
        let mut called = client
            .call(&self.http, target, Endpoint::ChatCompletions, &chat)
            .await;
        if let Ok(success) = &mut called.result {
            success.body = as_chat.answer(&success.body);
        }
        called
    }

    /// The client of `target`'s provider, or the failure of a call to one not configured.
    fn client(&self, target: &Target) -> Result<&ProviderClient, Failure> {
        self.get(&target.provider).ok_or_else(|| Failure {
            class: FailureClass::Request,
            code: ReasonCode::UnknownProvider,
            message: format!("provider {:?} is not configured", target.provider),
            status: None,
            retry_after: None,
        })
    }
}

/// A call the provider answered 2xx, its body not read yet.
struct Answered {
    response: reqwest::Response,
    headers: HeaderMap,
    /// The attempt's record so far (key, status, request id, rate-limit headers).
    outcome: CallOutcome,
}

impl ProviderClient {
    fn new(p: &ProviderConfig, control: Control) -> Result<Self, ProviderSetupError> {
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
            api: adapter(p),
            dialect: p.dialect(),
            keys,
            next_key: AtomicUsize::new(0),
            control,
        })
    }

    fn keyring(&self) -> Arc<tollgate::keyring::Keyring> {
        self.control.get().map(|d| d.keyring()).unwrap_or_default()
    }

    /// A key of the file, round robin over those that serve `target`'s model (all of them
    /// when none does), less those disabled at runtime (`ring`) while others remain.
    fn pick_file_key(&self, target: &Target, ring: &tollgate::keyring::Keyring) -> &ProviderKey {
        let enabled: Vec<&ProviderKey> = self
            .keys
            .iter()
            .filter(|k| !ring.disabled(&self.name, &k.name))
            .collect();
        let candidates = if enabled.is_empty() {
            self.keys.iter().collect()
        } else {
            enabled
        };
        let serving: Vec<&ProviderKey> = candidates
            .iter()
            .copied()
            .filter(|k| k.serves(&target.model))
            .collect();
        let pool = if serving.is_empty() { candidates } else { serving };
        let i = self.next_key.fetch_add(1, Ordering::Relaxed) % pool.len().max(1);
        pool[i]
    }

    /// The key the gate chose for `target` (a key of the file, or one added at runtime)
    /// while it may be used; else round robin over the usable keys that serve its model.
    fn pick_key(&self, target: &Target) -> ChosenKey {
        let ring = self.keyring();
        if let Some(name) = target.key.as_deref() {
            let file = self
                .keys
                .iter()
                .find(|k| k.name == name && !ring.disabled(&self.name, name));
            if let Some(k) = file {
                return ChosenKey {
                    name: k.name.clone(),
                    secret: k.secret.clone(),
                };
            }
            if let Some(secret) = ring.runtime_secret(&self.name, name) {
                return ChosenKey {
                    name: name.to_owned(),
                    secret: secret.clone(),
                };
            }
        }
        let runtime: Vec<(&str, &SecretString)> = ring.runtime_keys(&self.name, &target.model).collect();
        let file_serving = self
            .keys
            .iter()
            .filter(|k| k.serves(&target.model) && !ring.disabled(&self.name, &k.name))
            .count();
        let turn = self.next_key.fetch_add(1, Ordering::Relaxed);
        if !runtime.is_empty() && turn % (file_serving + runtime.len()) >= file_serving {
            let (name, secret) = runtime[turn % runtime.len()];
            return ChosenKey {
                name: name.to_owned(),
                secret: secret.clone(),
            };
        }
        let k = self.pick_file_key(target, &ring);
        ChosenKey {
            name: k.name.clone(),
            secret: k.secret.clone(),
        }
    }

    /// The one send path of plain and streamed calls: picks the key, builds the request
    /// through the adapter, sends it (bounded by the HTTP client's timeout), reads the
    /// headers for the attempt record and, for a non-2xx answer, reads the body, the
    /// rate-limit signals and classifies the failure. A 2xx comes back with its body
    /// unread: a plain call reads it whole, a stream event by event.
    async fn send(
        &self,
        http: &reqwest::Client,
        target: &Target,
        endpoint: Endpoint,
        request: &Value,
        mode: Mode,
    ) -> Result<Answered, CallOutcome> {
        let key = self.pick_key(target);
        let mut outcome = CallOutcome {
            key_name: key.name,
            reached: false,
            status: None,
            request_id: None,
            rate_limit: None,
            signals: Signals::default(),
            result: Err(Failure::network("request was not sent")),
        };
        let credential = match self.api.credential(http, &key.secret).await {
            Ok(credential) => credential,
            Err(failure) => {
                outcome.result = Err(failure);
                return Err(outcome);
            }
        };
        let builder = self
            .api
            .request(http, &credential, &target.model, endpoint, request, mode);
        let response = match builder.send().await {
            Ok(r) => r,
            Err(e) => {
                // Without a connection nothing was sent; any later failure (a timeout, a
                // reset) may come after the provider took the request and counted it.
                outcome.reached = !e.is_connect();
                outcome.result = Err(send_failure(e));
                return Err(outcome);
            }
        };
        outcome.reached = true;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        outcome.status = Some(status);
        outcome.request_id = request_id(&headers);
        outcome.rate_limit = self.rate_limit_headers(&headers);
        if !(200..300).contains(&status) {
            outcome.result = Err(match response.bytes().await {
                Ok(body) => {
                    outcome.signals = self.api.signals(self.dialect, &headers, &body, Utc::now());
                    self.api.classify_error(status, &headers, &body)
                }
                Err(e) => send_failure(e),
            });
            return Err(outcome);
        }
        Ok(Answered {
            response,
            headers,
            outcome,
        })
    }

    async fn call(
        &self,
        http: &reqwest::Client,
        target: &Target,
        endpoint: Endpoint,
        request: &Value,
    ) -> CallOutcome {
        let Answered {
            response,
            headers,
            mut outcome,
        } = match self.send(http, target, endpoint, request, Mode::Whole).await {
            Ok(answered) => answered,
            Err(outcome) => return outcome,
        };
        let status = response.status().as_u16();
        let body = match response.bytes().await {
            Ok(b) => b,
            Err(e) => {
                outcome.result = Err(send_failure(e));
                return outcome;
            }
        };
        outcome.signals = self.api.signals(self.dialect, &headers, b"", Utc::now());
        let model = target.model.as_str();
        outcome.result = self
            .api
            .parse_success(&body, endpoint, model)
            .map(|s| self.with_usage(s, model, endpoint, request))
            .map_err(|reason| Failure::bad_response(reason, status));
        outcome
    }

    /// A success whose body has no `usage` (a provider or proxy fault) is settled with
    /// the request's estimate — input by the tokenizer or char rule, output at its cap for
    /// each choice —
    /// so its reservation is kept whole rather than refunded as if nothing was used; the
    /// result says so in `usage.tollgate_estimated`.
    fn with_usage(&self, mut success: Success, model: &str, endpoint: Endpoint, request: &Value) -> Success {
        // Moderations report no usage: they cost no tokens.
        if endpoint == Endpoint::Moderations || success.body.get("usage").is_some_and(Value::is_object) {
            return success;
        }
        let input = i64::from(tollgate::estimate::endpoint_input_tokens(
            endpoint,
            request,
            [model],
        ));
        let output = i64::from(tollgate::estimate::endpoint_output_tokens(endpoint, request));
        tracing::warn!(provider = %self.name, model, "provider answered without usage; settling with the estimate");
        tollgate::metrics::usage_missing(&self.name, model);
        success.usage = Usage {
            input_tokens: input,
            output_tokens: output,
            cached_tokens: 0,
        };
        // In the answer's own shape: Responses' and Anthropic's name their counts alike.
        let usage = match endpoint {
            Endpoint::Messages | Endpoint::Responses => serde_json::json!({
                "input_tokens": input,
                "output_tokens": output,
                "tollgate_estimated": true,
            }),
            _ => serde_json::json!({
                "prompt_tokens": input,
                "completion_tokens": output,
                "total_tokens": input + output,
                "tollgate_estimated": true,
            }),
        };
        if let Some(obj) = success.body.as_object_mut() {
            obj.insert("usage".to_owned(), usage);
        }
        success
    }

    /// Keeps the headers that carry rate-limit state, for the attempt record.
    fn rate_limit_headers(&self, headers: &HeaderMap) -> Option<Value> {
        let mut map = Map::new();
        for (name, value) in headers {
            let n = name.as_str();
            if self.api.keeps_header(n)
                && let Ok(v) = value.to_str()
            {
                map.insert(n.to_owned(), Value::String(v.to_owned()));
            }
        }
        (!map.is_empty()).then_some(Value::Object(map))
    }
}

impl CallOutcome {
    /// A call refused before anything was sent.
    fn refused(failure: Failure) -> Self {
        Self {
            key_name: String::new(),
            reached: false,
            status: None,
            request_id: None,
            rate_limit: None,
            signals: Signals::default(),
            result: Err(failure),
        }
    }

    /// Whether the provider's limits counted the call: it may have reached the provider,
    /// and was not answered with an overload (a 5xx or 529 did not serve it, so an outage
    /// does not use up capacity nobody used).
    pub fn counted(&self) -> bool {
        self.reached && !matches!(&self.result, Err(f) if f.class == FailureClass::Overload)
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
    // OpenAI's, Anthropic's, AWS's.
    ["x-request-id", "request-id", "x-amzn-requestid"]
        .iter()
        .find_map(|h| headers.get(*h))
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
}

/// Reads a token count of a usage object: 0 when absent or not an integer, and within
/// 0..=[`MAX_USAGE_TOKENS`] (a count past `i64::MAX` is the most). A provider's nonsense
/// then neither settles a bucket with negative usage (giving back more than was
/// reserved) nor overflows the sums an adapter makes of its counts.
pub(crate) fn int(v: &Value, path: &[&str]) -> i64 {
    path.iter()
        .try_fold(v, |v, k| v.get(*k))
        .and_then(|n| n.as_i64().or_else(|| n.as_u64().map(|_| i64::MAX)))
        .unwrap_or(0)
        .clamp(0, MAX_USAGE_TOKENS)
}

/// An assistant message of a chat completion: its text and tool calls, `content` null when
/// it calls tools and says nothing, as OpenAI sends it.
pub(crate) fn assistant_message(text: String, tool_calls: Vec<Value>) -> Value {
    match tool_calls.is_empty() {
        true => serde_json::json!({"role": "assistant", "content": text}),
        false => serde_json::json!({"role": "assistant",
            "content": (!text.is_empty()).then_some(text), "tool_calls": tool_calls}),
    }
}

/// The OpenAI `chat.completion` an adapter translated a provider's answer into:
/// one choice with `text` and its `tool_calls`, and the usage when the provider `reported` it (no usage is
/// invented as zeros: the send path sees it missing and settles with the estimate).
pub(crate) fn completion(
    id: Value,
    model: Value,
    text: String,
    tool_calls: Vec<Value>,
    finish_reason: &str,
    usage: Option<Value>,
) -> Value {
    let message = assistant_message(text, tool_calls);
    let mut body = serde_json::json!({
        "id": id,
        "object": "chat.completion",
        "created": Utc::now().timestamp(),
        "model": model,
        "choices": [{
            "index": 0,
            "message": message,
            "finish_reason": finish_reason,
        }],
    });
    if let (Some(usage), Some(obj)) = (usage, body.as_object_mut()) {
        obj.insert("usage".to_owned(), usage);
    }
    body
}

#[cfg(test)]
mod tests {
    use serde_json::json;
    use tollgate::estimate;

    use super::*;

    /// The output cap in a provider's body, where that provider's API carries it; the
    /// larger where the body carries both (the client set both).
    fn sent_cap(kind: ProviderKind, body: &Value) -> Option<i64> {
        let field = |k: &str| body.get(k).and_then(Value::as_i64);
        match kind {
            ProviderKind::Gemini => body
                .pointer("/generationConfig/maxOutputTokens")
                .and_then(Value::as_i64),
            ProviderKind::Anthropic => field("max_tokens"),
            _ => field("max_completion_tokens").max(field("max_tokens")),
        }
    }

    /// Every adapter sends the output cap the gate reserved for, whether the request
    /// named one or not: never more than was reserved, so `n` choices of it are the whole
    /// output reservation.
    /// Found by the `provider_responses` fuzz target: a Gemini answer with
    /// `"promptTokenCount": -7` was read as -7 input tokens, which settles a bucket with
    /// more than its reservation back; counts near `i64::MAX` overflowed the sums the
    /// Anthropic and Gemini adapters make (a panic in debug builds, a wrapped negative in
    /// release ones).
    #[test]
    fn usage_a_provider_reports_is_never_negative_and_never_overflows() {
        let max = MAX_USAGE_TOKENS;
        let oai = openai::parse_success(
            br#"{"choices":[],"usage":{"prompt_tokens":-5,"completion_tokens":18446744073709551615}}"#,
            Endpoint::ChatCompletions,
        )
        .unwrap();
        assert_eq!((oai.usage.input_tokens, oai.usage.output_tokens), (0, max));
        let gem = gemini::parse_success(
            br#"{"candidates":[{}],"usageMetadata":{"promptTokenCount":-7,"candidatesTokenCount":9223372036854775807,"thoughtsTokenCount":9223372036854775807}}"#,
            "g",
        )
        .unwrap();
        assert_eq!((gem.usage.input_tokens, gem.usage.output_tokens), (0, 2 * max));
        let big = i64::MAX;
        let ant = anthropic::parse_success(
            format!(r#"{{"content":[],"usage":{{"input_tokens":{big},"cache_creation_input_tokens":{big},"cache_read_input_tokens":{big},"output_tokens":-1}}}}"#).as_bytes(),
        )
        .unwrap();
        assert_eq!(
            (
                ant.usage.input_tokens,
                ant.usage.cached_tokens,
                ant.usage.output_tokens
            ),
            (3 * max, max, 0)
        );
        assert_eq!(ant.body["usage"]["total_tokens"], 3 * max);
        let events = [
            "data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":-4}}}\n\n",
            "data: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":-1}}\n\n",
            "data: {\"type\":\"message_stop\"}\n\n",
        ];
        let mut stream = streaming::ChatStream::canned(Box::new(anthropic::Events::default()), &events);
        futures::executor::block_on(stream.drain());
        assert_eq!(
            (stream.usage().input_tokens, stream.usage().output_tokens),
            (0, 0)
        );
    }

    #[test]
    fn the_cap_sent_is_the_cap_reserved() {
        let config = Config::parse(
            r#"
            [[providers]]
            name = "oai"
            kind = "openai"
            base_url = "https://api.openai.com/v1"
            keys = [{ name = "k", value = "sk-1" }]
            models = ["gpt-4o-mini"]
            [[providers]]
            name = "groq"
            kind = "openai-compatible"
            base_url = "https://api.groq.com/openai/v1"
            keys = [{ name = "k", value = "gsk-1" }]
            models = ["llama-3.3-70b-versatile"]
            [[providers]]
            name = "az"
            kind = "azure"
            base_url = "https://res.openai.azure.com"
            keys = [{ name = "k", value = "az-1" }]
            models = ["gpt-4o-deploy"]
            [[providers]]
            name = "ant"
            kind = "anthropic"
            base_url = "https://api.anthropic.com"
            keys = [{ name = "k", value = "ak-1" }]
            models = ["claude-3-5-haiku-latest"]
            [[providers]]
            name = "gem"
            kind = "gemini"
            base_url = "https://generativelanguage.googleapis.com"
            keys = [{ name = "k", value = "g-1" }]
            models = ["gemini-2.0-flash"]
            [[tenants]]
            name = "t"
            api_key = "tk-test"
            "#,
            "cap test",
        )
        .unwrap();
        let messages = json!([{"role": "user", "content": "hi"}]);
        let requests = [
            json!({"messages": messages}),
            json!({"messages": messages, "n": 4}),
            json!({"messages": messages, "max_tokens": 50}),
            json!({"messages": messages, "max_completion_tokens": 70, "n": 2}),
            json!({"messages": messages, "max_completion_tokens": 30, "max_tokens": 60}),
        ];
        for p in &config.providers {
            let api = adapter(p);
            for request in &requests {
                for mode in [Mode::Whole, Mode::Stream] {
                    let body = api.body(&p.models[0], Endpoint::ChatCompletions, request, mode);
                    let sent = sent_cap(p.kind, &body);
                    assert_eq!(sent, Some(estimate::output_cap(request)), "{}: {request}", p.name);
                    assert_eq!(
                        sent.map(|cap| cap * estimate::choices(request)),
                        Some(i64::from(estimate::output_tokens(request))),
                        "{}: {request}",
                        p.name
                    );
                }
            }
        }
        // With no cap of its own, each API gets the one it reads.
        let bare = &requests[0];
        let field_of = |name: &str| {
            let p = config.provider(name).unwrap();
            let body = adapter(p).body(&p.models[0], Endpoint::ChatCompletions, bare, Mode::Whole);
            ["max_completion_tokens", "max_tokens"]
                .into_iter()
                .filter(|k| body.get(*k).is_some())
                .collect::<Vec<_>>()
        };
        assert_eq!(field_of("oai"), ["max_completion_tokens"]);
        assert_eq!(field_of("az"), ["max_completion_tokens"]);
        assert_eq!(field_of("groq"), ["max_tokens"]);
        assert_eq!(field_of("ant"), ["max_tokens"]);
    }
}
