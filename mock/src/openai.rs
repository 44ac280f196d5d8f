//! `POST /v1/chat/completions`, `POST /v1/embeddings` and `POST /v1/moderations` in
//! OpenAI's shape (`docs/PROVIDERS.md` §1.1, §1.2, §1.4):
//! `Authorization: Bearer` keys, `x-ratelimit-*` headers with Go-style relative
//! durations, `{"error":{message,type,param,code}}` bodies, 429s of type `requests` /
//! `tokens` with `retry-after` and `retry-after-ms`, and the non-retryable
//! "Request too large" 429.
//!
//! The `requests` headers report RPM, or RPD when the project has no RPM (Groq-like);
//! the `tokens` headers report TPM. Absent limits send no headers.
//!
//! `n` choices (1..=128) are generated as OpenAI does: the prompt counted once, each choice
//! up to the output cap; TPM is charged `input + n × max_tokens` and `usage.completion_tokens`
//! is the choices' sum.

use std::time::Instant;

use axum::body::{Body, to_bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::Response;
use serde::Serialize;

use super::buckets::{Admission, BucketView, Charge, Denial, LimitKind, LimitsView};
use super::reply::Respond;
use super::request::{ChatRequest, Fixed, input_tokens};
use super::stats::InFlight;
use super::stream::{self, Shape, StreamGuard};
use super::{Inner, KeyLookup, MAX_BODY_BYTES, MockProvider, ProviderKind, ceil_secs, hex_id};

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorDetail<'a>,
}

#[derive(Serialize)]
struct ErrorDetail<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

/// A Chat Completions response body (also Azure's).
#[derive(Serialize)]
pub(super) struct ChatCompletion<'a> {
    id: String,
    object: &'static str,
    created: i64,
    model: &'a str,
    choices: Vec<Choice<'a>>,
    usage: Usage,
}

#[derive(Serialize)]
struct Choice<'a> {
    index: u32,
    message: AssistantMessage<'a>,
    logprobs: Option<()>,
    finish_reason: &'static str,
}

#[derive(Serialize)]
struct AssistantMessage<'a> {
    role: &'static str,
    content: &'a str,
    refusal: Option<()>,
}

#[derive(Serialize)]
struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
    total_tokens: u64,
}

/// Per-request context for building responses.
pub(super) struct Reply<'a> {
    inner: &'a Inner,
    started: Instant,
    request_id: String,
    project: Option<usize>,
}

/// The key of an `Authorization: Bearer` header, if it holds one.
pub(super) fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|k| !k.is_empty())
}

const RATE_LIMIT_DOCS: &str = "Visit https://platform.openai.com/account/rate-limits to learn more.";

impl<'a> Reply<'a> {
    pub(super) fn new(inner: &'a Inner) -> Self {
        Reply {
            inner,
            started: Instant::now(),
            request_id: format!("req_{}", hex_id(32)),
            project: None,
        }
    }

    /// The project of the request's bearer key (set on the reply) and the body read as
    /// `T`, or the answer OpenAI sends (401, or 400 for a body that cannot be read, is not
    /// JSON or not of `T`'s shape).
    pub(super) async fn open<T: serde::de::DeserializeOwned>(
        &mut self,
        req: Request,
    ) -> Result<(usize, T), Box<Response>> {
        let (parts, body) = req.into_parts();
        let project = self.authenticate(&parts.headers)?;
        let Ok(bytes) = to_bytes(body, MAX_BODY_BYTES).await else {
            return Err(Box::new(self.bad_request("The request body could not be read.")));
        };
        match serde_json::from_slice(&bytes) {
            Ok(body) => Ok((project, body)),
            Err(e) if e.is_syntax() || e.is_eof() => Err(Box::new(self.not_json())),
            Err(e) => Err(Box::new(self.bad_request(&format!("Invalid request body: {e}")))),
        }
    }

    /// The project of the request's bearer key (set on the reply), or the 401 OpenAI sends.
    fn authenticate(&mut self, headers: &HeaderMap) -> Result<usize, Box<Response>> {
        let Some(key) = bearer(headers) else {
            return Err(Box::new(self.unauthorized(
                "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY), or as the password field (with blank username) if you're accessing the API from your browser and are prompted for a username and password. You can obtain an API key from https://platform.openai.com/account/api-keys.",
                None,
            )));
        };
        match self.inner.lookup(ProviderKind::Openai, key) {
            KeyLookup::Valid(project) => {
                self.project = Some(project);
                Ok(project)
            }
            KeyLookup::Revoked | KeyLookup::Unknown => {
                let msg = format!(
                    "Incorrect API key provided: {}. You can find your API key at https://platform.openai.com/account/api-keys.",
                    redact(key)
                );
                Err(Box::new(self.unauthorized(&msg, Some("invalid_api_key"))))
            }
        }
    }

    /// OpenAI's 400 for a body that is not JSON.
    fn not_json(&self) -> Response {
        self.bad_request(
            "We could not parse the JSON body of your request. (HINT: This likely means you aren't using your HTTP library correctly. The OpenAI API expects a JSON payload, but what was sent was not valid JSON. If you have trouble figuring out how to fix this, please contact us through our help center at help.openai.com.)",
        )
    }

    /// What comes before a request's admission: the model checked, and a fault drawn —
    /// one answered now (`Err`), or one to apply to the answer (`faults::after`).
    pub(super) async fn before_admission(
        &self,
        project: usize,
        model: &str,
    ) -> Result<Option<super::faults::Injected>, Box<Response>> {
        if !self.inner.model_allowed(project, model) {
            return Err(Box::new(self.model_not_found(model)));
        }
        let injected = self.inner.fault_or_inject(project);
        if let Some(status) = injected.status {
            return Err(Box::new(self.fault(status)));
        }
        match super::faults::before(self.inner, injected.fault).await {
            Some(answer) => Err(Box::new(answer)),
            None => Ok(injected.fault),
        }
    }

    /// OpenAI's 404 for a model the project may not use.
    fn model_not_found(&self, model: &str) -> Response {
        let msg = format!("The model `{model}` does not exist or you do not have access to it.");
        self.error(
            StatusCode::NOT_FOUND,
            &msg,
            "invalid_request_error",
            Some("model_not_found"),
            &self.inner.totals.not_found,
        )
    }
}

pub(super) async fn chat_completions(State(p): State<MockProvider>, req: Request) -> Response {
    let inner = &*p.inner;
    let in_flight = inner.totals.begin();
    let mut reply = Reply::new(inner);
    let (project, req): (usize, ChatRequest) = match reply.open(req).await {
        Ok(opened) => opened,
        Err(refused) => return *refused,
    };
    let Some(model) = req.model.as_deref().filter(|m| !m.is_empty()) else {
        return reply.bad_request("you must provide a model parameter");
    };
    let Some(messages) = req.messages.as_ref() else {
        return reply.bad_request("Missing required parameter: 'messages'.");
    };
    if messages.count == 0 {
        return reply.bad_request("[] is too short - 'messages'");
    }
    if let Some(message) = &messages.tool_turn_error {
        return reply.bad_request(message);
    }
    let max_out = req.max_out();
    if max_out == Some(0) {
        return reply.bad_request("max_tokens must be at least 1.");
    }
    let choices = match req.choices() {
        Ok(n) => n,
        Err(message) => return reply.bad_request(&message),
    };
    let fault = match reply.before_admission(project, model).await {
        Ok(fault) => fault,
        Err(answer) => return *answer,
    };
    if req.service_tier.as_deref() == Some("flex") && inner.flex_refuses() {
        return reply.error(
            StatusCode::TOO_MANY_REQUESTS,
            "Resource Unavailable: flex processing has no capacity for this request right now. Retry later, or send it without `service_tier: \"flex\"`.",
            "resource_unavailable",
            Some("resource_unavailable"),
            &inner.totals.flex_unavailable,
        );
    }

    let input = input_tokens(messages, None);
    let chat = Admit {
        project,
        model,
        input,
        max_out,
        choices,
        stream: req.stream == Some(true),
        include_usage: req.stream_options.as_ref().and_then(|o| o.include_usage) == Some(true),
        fixed: req.fixed_answer(),
    };
    let resp = complete(&p, in_flight, &reply, chat, |d, view| {
        reply.rate_limited(model, d, view)
    })
    .await;
    super::faults::after(fault, resp).await
}

/// Most inputs one embeddings request may hold.
const MAX_EMBEDDING_INPUTS: usize = 2048;
/// Dimensions of a mock embedding when the request names none (real models have 1536 or
/// more; tests need few).
const DEFAULT_DIMENSIONS: u64 = 8;

/// `POST /v1/embeddings`: each input counted (strings a token per started four characters,
/// token ids one each) and charged against TPM alone — embeddings produce no output —
/// then answered with one vector per input, as floats or, with `encoding_format:
/// "base64"` (what the OpenAI SDK asks for by default), as base64 of little-endian f32s.
pub(super) async fn embeddings(State(p): State<MockProvider>, req: Request) -> Response {
    let inner = &*p.inner;
    let _in_flight = inner.totals.begin();
    let mut reply = Reply::new(inner);
    let (project, body): (usize, serde_json::Value) = match reply.open(req).await {
        Ok(opened) => opened,
        Err(refused) => return *refused,
    };
    let embeddings = match Embeddings::check(&body) {
        Ok(e) => e,
        Err(message) => return reply.bad_request(&message),
    };
    let model = embeddings.model;
    let fault = match reply.before_admission(project, model).await {
        Ok(fault) => fault,
        Err(answer) => return *answer,
    };
    let tokens = embeddings.tokens();
    let charge = Charge {
        tokens,
        input: tokens,
        output: 0,
    };
    let view = match inner.admit(project, charge, tokens, 0) {
        Admission::Admitted(view) => view,
        Admission::Denied(denial, view) => return reply.rate_limited(model, &denial, &view),
    };
    drop(inner.generate(project, &view, 0, 0).await);
    let answer = embeddings.answer();
    super::stats::bump(&inner.totals.succeeded);
    let resp = reply.json(StatusCode::OK, &answer, Some(&view));
    super::faults::after(fault, resp).await
}

/// The categories a moderation reports, each with its flag and score.
const MODERATION_CATEGORIES: [&str; 13] = [
    "harassment",
    "harassment/threatening",
    "hate",
    "hate/threatening",
    "illicit",
    "illicit/violent",
    "self-harm",
    "self-harm/instructions",
    "self-harm/intent",
    "sexual",
    "sexual/minors",
    "violence",
    "violence/graphic",
];

/// `POST /v1/moderations`: a result per input (one for a string or a list of parts),
/// nothing flagged, charged one request and no tokens.
pub(super) async fn moderations(State(p): State<MockProvider>, req: Request) -> Response {
    let inner = &*p.inner;
    let _in_flight = inner.totals.begin();
    let mut reply = Reply::new(inner);
    let (project, body): (usize, serde_json::Value) = match reply.open(req).await {
        Ok(opened) => opened,
        Err(refused) => return *refused,
    };
    let moderation = match Moderation::check(&body) {
        Ok(m) => m,
        Err(message) => return reply.bad_request(&message),
    };
    let model = moderation.model;
    let fault = match reply.before_admission(project, model).await {
        Ok(fault) => fault,
        Err(answer) => return *answer,
    };
    let charge = Charge {
        tokens: 0,
        input: 0,
        output: 0,
    };
    let view = match inner.admit(project, charge, 0, 0) {
        Admission::Admitted(view) => view,
        Admission::Denied(denial, view) => return reply.rate_limited(model, &denial, &view),
    };
    drop(inner.generate(project, &view, 0, 0).await);
    let answer = moderation.answer();
    super::stats::bump(&inner.totals.succeeded);
    let resp = reply.json(StatusCode::OK, &answer, Some(&view));
    super::faults::after(fault, resp).await
}

/// A moderations request as OpenAI reads it.
pub(super) struct Moderation<'a> {
    pub model: &'a str,
    /// Results answered: one per string of a list, one for a string or a list of parts.
    results: usize,
}

impl<'a> Moderation<'a> {
    /// The request checked; the message of OpenAI's 400 when its `input` is malformed.
    pub(super) fn check(body: &'a serde_json::Value) -> Result<Self, String> {
        let model = body
            .get("model")
            .and_then(|m| m.as_str())
            .unwrap_or("omni-moderation-latest");
        let results = match body.get("input") {
            Some(serde_json::Value::String(s)) if !s.is_empty() => 1,
            Some(serde_json::Value::Array(items))
                if items.iter().all(|i| i.is_string()) && !items.is_empty() =>
            {
                items.len()
            }
            Some(serde_json::Value::Array(items)) if !items.is_empty() => 1,
            _ => {
                return Err("'$.input' is invalid. Please check the API reference: https://platform.openai.com/docs/api-reference.".to_owned());
            }
        };
        Ok(Self { model, results })
    }

    /// The answer: nothing flagged.
    pub(super) fn answer(&self) -> serde_json::Value {
        let each = |v: serde_json::Value| {
            MODERATION_CATEGORIES
                .iter()
                .map(|c| (c.to_string(), v.clone()))
                .collect::<serde_json::Map<_, _>>()
        };
        let result = serde_json::json!({
            "flagged": false,
            "categories": each(serde_json::json!(false)),
            "category_scores": each(serde_json::json!(0.0001)),
            "category_applied_input_types": each(serde_json::json!(["text"])),
        });
        serde_json::json!({
            "id": format!("modr-{}", hex_id(32)),
            "model": self.model,
            "results": vec![result; self.results],
        })
    }
}

/// An embeddings request as OpenAI reads it.
pub(super) struct Embeddings<'a> {
    pub model: &'a str,
    /// The tokens of each input.
    inputs: Vec<u64>,
    base64: bool,
    dimensions: u64,
}

impl<'a> Embeddings<'a> {
    /// The request checked; the message of OpenAI's 400 when it is malformed.
    pub(super) fn check(body: &'a serde_json::Value) -> Result<Self, String> {
        let model = body
            .get("model")
            .and_then(|m| m.as_str())
            .filter(|m| !m.is_empty())
            .ok_or("you must provide a model parameter")?;
        let input = body.get("input").ok_or("'input' is a required property")?;
        let inputs = embedding_inputs(input).ok_or(
            "'$.input' is invalid. Please check the API reference: https://platform.openai.com/docs/api-reference.",
        )?;
        let base64 = match body.get("encoding_format").and_then(|f| f.as_str()) {
            None | Some("float") => false,
            Some("base64") => true,
            Some(other) => {
                return Err(format!(
                    "Invalid value for 'encoding_format': '{other}'. Supported values are: 'float' and 'base64'."
                ));
            }
        };
        let dimensions = match body.get("dimensions") {
            None => DEFAULT_DIMENSIONS,
            Some(d) => d
                .as_u64()
                .filter(|d| (1..=4096).contains(d))
                .ok_or("Invalid value for 'dimensions': must be a positive integer.")?,
        };
        Ok(Self {
            model,
            inputs,
            base64,
            dimensions,
        })
    }

    /// How many inputs it holds.
    pub(super) fn inputs(&self) -> usize {
        self.inputs.len()
    }

    /// The tokens of every input, all charged as input.
    pub(super) fn tokens(&self) -> u64 {
        self.inputs.iter().sum()
    }

    /// The answer: a vector per input, with the usage.
    pub(super) fn answer(&self) -> serde_json::Value {
        let data: Vec<serde_json::Value> = (0..self.inputs.len())
            .map(|index| {
                let vector: Vec<f32> = (0..self.dimensions)
                    .map(|d| ((index as u64 + 1) * (d + 1) % 97) as f32 / 97.0)
                    .collect();
                let embedding = if self.base64 {
                    use base64::Engine;
                    let bytes: Vec<u8> = vector.iter().flat_map(|v| v.to_le_bytes()).collect();
                    serde_json::Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
                } else {
                    serde_json::json!(vector)
                };
                serde_json::json!({"object": "embedding", "index": index, "embedding": embedding})
            })
            .collect();
        let tokens = self.tokens();
        serde_json::json!({
            "object": "list",
            "data": data,
            "model": self.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        })
    }
}

/// The tokens of each input of an embeddings `input`, or `None` when it is not one of the
/// shapes OpenAI takes: a non-empty string, 1 to 2048 non-empty strings, token ids, or
/// non-empty arrays of token ids.
fn embedding_inputs(input: &serde_json::Value) -> Option<Vec<u64>> {
    use serde_json::Value;
    let text = |s: &str| (!s.is_empty()).then(|| (s.chars().count() as u64).div_ceil(4));
    let ids = |v: &[Value]| (!v.is_empty() && v.iter().all(Value::is_u64)).then_some(v.len() as u64);
    match input {
        Value::String(s) => Some(vec![text(s)?]),
        Value::Array(items) if items.is_empty() || items.len() > MAX_EMBEDDING_INPUTS => None,
        Value::Array(items) if items.iter().all(Value::is_number) => Some(vec![ids(items)?]),
        Value::Array(items) => items
            .iter()
            .map(|item| match item {
                Value::String(s) => text(s),
                Value::Array(v) => ids(v),
                _ => None,
            })
            .collect(),
        _ => None,
    }
}

/// A checked Chat Completions request, ready for admission.
pub(super) struct Admit<'a> {
    pub project: usize,
    pub model: &'a str,
    pub input: u64,
    pub max_out: Option<u64>,
    /// `n`: choices generated, each up to `max_out`.
    pub choices: u64,
    pub stream: bool,
    pub include_usage: bool,
    /// The function call or JSON answered instead of canned words.
    pub fixed: Option<Fixed>,
}

/// Admits a checked Chat Completions request and answers it, as JSON or as a stream, with
/// `reply`'s headers; a denial is answered by `rate_limited`. Shared with Azure, whose
/// bodies are OpenAI's.
pub(super) async fn complete(
    p: &MockProvider,
    in_flight: InFlight<'_>,
    reply: &impl Respond,
    c: Admit<'_>,
    rate_limited: impl FnOnce(&Denial, &LimitsView) -> Response,
) -> Response {
    let inner = &*p.inner;
    let reserved = c.max_out.unwrap_or(inner.output_tokens).saturating_mul(c.choices);
    let per_choice = inner.completion_tokens(c.max_out);
    let output = per_choice.saturating_mul(c.choices);
    let charge = Charge {
        tokens: c.input.saturating_add(reserved),
        input: c.input,
        output: reserved,
    };
    let view = match inner.admit(c.project, charge, c.input, output) {
        Admission::Admitted(view) => view,
        Admission::Denied(denial, view) => return rate_limited(&denial, &view),
    };
    let finish_reason = if per_choice < inner.output_tokens {
        "length"
    } else {
        "stop"
    };
    if let Some(fixed) = &c.fixed {
        let call = FixedAnswer {
            call_id: format!("call_{}", super::hex_id(24)),
            fixed,
        };
        let output = call.tokens().min(c.max_out.unwrap_or(u64::MAX));
        let refund = inner.generate(c.project, &view, reserved, output).await;
        super::stats::bump(&inner.totals.succeeded);
        let id = format!("chatcmpl-{}", super::uuid_v7(inner));
        let response = if c.stream {
            let body = call.chunks(
                &id,
                inner.unix_secs(),
                c.model,
                (c.input, output),
                c.include_usage,
            );
            reply.stream(Body::from(body), &view)
        } else {
            let completion = call.completion(&id, inner.unix_secs(), c.model, (c.input, output));
            reply.json(StatusCode::OK, &completion, Some(&view))
        };
        drop(refund);
        return response;
    }
    if c.stream {
        super::stats::bump(&inner.totals.succeeded);
        in_flight.hand_over();
        let otpm_reserved = if view.otpm.is_some() { reserved } else { 0 };
        let guard = StreamGuard::new(p.clone(), c.project, output, otpm_reserved);
        let shape = Shape::OpenAi {
            id: format!("chatcmpl-{}", super::uuid_v7(inner)),
            created: inner.unix_secs(),
            model: c.model.to_owned(),
            finish_reason,
            include_usage: c.include_usage,
            input: c.input,
            choices: c.choices,
        };
        return reply.stream(stream::body(guard, shape), &view);
    }
    let refund = inner.generate(c.project, &view, reserved, output).await;
    let completion = completion(inner, c.model, c.input, per_choice, c.choices, finish_reason);
    super::stats::bump(&inner.totals.succeeded);
    let response = reply.json(StatusCode::OK, &completion, Some(&view));
    drop(refund);
    response
}

/// A function call, or the JSON a `response_format` asked for, answered instead of canned
/// words.
struct FixedAnswer<'a> {
    /// The call's id (unused for JSON).
    call_id: String,
    fixed: &'a Fixed,
}

impl FixedAnswer<'_> {
    /// Output tokens of the answer: a token per started four characters of its text.
    fn tokens(&self) -> u64 {
        (self.fixed.text().chars().count() as u64).div_ceil(4).max(1)
    }

    fn call(&self, name: &str, arguments: &str) -> serde_json::Value {
        serde_json::json!({"id": self.call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    }

    fn finish_reason(&self) -> &'static str {
        match self.fixed {
            Fixed::Call { .. } => "tool_calls",
            Fixed::Json(_) => "stop",
        }
    }

    /// The answer as a chat completion (`usage` is `(input, output)`).
    fn completion(&self, id: &str, created: i64, model: &str, usage: (u64, u64)) -> serde_json::Value {
        let message = match self.fixed {
            Fixed::Call { name, arguments } => serde_json::json!({"role": "assistant", "content": null,
                "refusal": null, "tool_calls": [self.call(name, arguments)]}),
            Fixed::Json(text) => serde_json::json!({"role": "assistant", "content": text, "refusal": null}),
        };
        serde_json::json!({"id": id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": null, "finish_reason": self.finish_reason()}],
            "usage": {"prompt_tokens": usage.0, "completion_tokens": usage.1, "total_tokens": usage.0 + usage.1}})
    }

    /// The answer as the chat stream sends it: the role (and a call's id and name with
    /// empty arguments), the text in two deltas, the finish, the usage chunk if asked,
    /// `[DONE]`.
    fn chunks(&self, id: &str, created: i64, model: &str, usage: (u64, u64), include_usage: bool) -> String {
        let text = self.fixed.text();
        let half = text
            .char_indices()
            .nth(text.chars().count() / 2)
            .map_or(text.len(), |(i, _)| i);
        let chunk = |delta: serde_json::Value, finish: Option<&str>| {
            serde_json::json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}]})
        };
        let (opening, fragment): (serde_json::Value, fn(&str) -> serde_json::Value) = match self.fixed {
            Fixed::Call { name, .. } => {
                let mut first = self.call(name, "");
                first["index"] = 0.into();
                (
                    serde_json::json!({"role": "assistant", "content": null, "tool_calls": [first]}),
                    |part| serde_json::json!({"tool_calls": [{"index": 0, "function": {"arguments": part}}]}),
                )
            }
            Fixed::Json(_) => (
                serde_json::json!({"role": "assistant", "content": ""}),
                |part| serde_json::json!({"content": part}),
            ),
        };
        let mut chunks = vec![
            chunk(opening, None),
            chunk(fragment(&text[..half]), None),
            chunk(fragment(&text[half..]), None),
            chunk(serde_json::json!({}), Some(self.finish_reason())),
        ];
        if include_usage {
            chunks.push(serde_json::json!({"id": id, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [],
                "usage": {"prompt_tokens": usage.0, "completion_tokens": usage.1, "total_tokens": usage.0 + usage.1}}));
        }
        let mut body: String = chunks.iter().map(|c| format!("data: {c}\n\n")).collect();
        body.push_str("data: [DONE]\n\n");
        body
    }
}

/// The completion of an admitted request: `choices` choices of `output` canned words each.
pub(super) fn completion<'a>(
    inner: &'a Inner,
    model: &'a str,
    input: u64,
    output: u64,
    choices: u64,
    finish_reason: &'static str,
) -> ChatCompletion<'a> {
    let completion_tokens = output.saturating_mul(choices);
    ChatCompletion {
        id: format!("chatcmpl-{}", super::uuid_v7(inner)),
        object: "chat.completion",
        created: inner.unix_secs(),
        model,
        choices: (0..choices.min(super::request::MAX_CHOICES))
            .map(|index| Choice {
                index: index as u32,
                message: AssistantMessage {
                    role: "assistant",
                    content: inner.text.words(output),
                    refusal: None,
                },
                logprobs: None,
                finish_reason,
            })
            .collect(),
        usage: Usage {
            prompt_tokens: input,
            completion_tokens,
            total_tokens: input + completion_tokens,
        },
    }
}

impl Respond for Reply<'_> {
    fn respond(
        &self,
        status: StatusCode,
        body: Body,
        content_type: &'static str,
        view: Option<&LimitsView>,
    ) -> Response {
        let mut resp = super::reply::base(status, body, content_type);
        let h = resp.headers_mut();
        if let Ok(v) = HeaderValue::from_str(&self.request_id) {
            h.insert("x-request-id", v);
        }
        h.insert("openai-version", HeaderValue::from_static("2020-10-01"));
        h.insert(
            "openai-processing-ms",
            HeaderValue::from(u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)),
        );
        if let Some(org) = self.project.and_then(|p| self.inner.projects[p].org.clone()) {
            h.insert("openai-organization", org);
        }
        if let Some(view) = view.filter(|_| self.inner.send_rate_limit_headers) {
            rate_limit_headers(h, view);
        }
        resp
    }
}

impl Reply<'_> {
    /// An error in OpenAI's shape, with the project's limits in the headers if known.
    fn error(
        &self,
        status: StatusCode,
        message: &str,
        kind: &str,
        code: Option<&str>,
        counter: &std::sync::atomic::AtomicU64,
    ) -> Response {
        super::stats::bump(counter);
        let view = self.project.map(|p| self.inner.view(p));
        let body = ErrorBody {
            error: ErrorDetail {
                message,
                kind,
                param: None,
                code,
            },
        };
        self.json(status, &body, view.as_ref())
    }

    fn unauthorized(&self, message: &str, code: Option<&str>) -> Response {
        self.error(
            StatusCode::UNAUTHORIZED,
            message,
            "invalid_request_error",
            code,
            &self.inner.totals.unauthorized,
        )
    }

    pub(super) fn bad_request(&self, message: &str) -> Response {
        self.error(
            StatusCode::BAD_REQUEST,
            message,
            "invalid_request_error",
            None,
            &self.inner.totals.bad_request,
        )
    }

    fn fault(&self, status: StatusCode) -> Response {
        let message = match status.as_u16() {
            500 => "The server had an error while processing your request. Sorry about that!",
            _ => "The server is overloaded or not ready yet.",
        };
        let view = self.project.map(|p| self.inner.view(p));
        let body = ErrorBody {
            error: ErrorDetail {
                message,
                kind: "server_error",
                param: None,
                code: None,
            },
        };
        self.json(status, &body, view.as_ref())
    }

    pub(super) fn rate_limited(&self, model: &str, d: &Denial, view: &LimitsView) -> Response {
        let org = self.project.map_or("", |p| self.inner.projects[p].name.as_str());
        let (what, abbr, kind) = match d.kind {
            LimitKind::Rpm => ("requests per min", "RPM", "requests"),
            LimitKind::Rpd => ("requests per day", "RPD", "requests"),
            LimitKind::Tpm => ("tokens per min", "TPM", "tokens"),
            LimitKind::Itpm => ("input tokens per min", "ITPM", "tokens"),
            LimitKind::Otpm => ("output tokens per min", "OTPM", "tokens"),
        };
        let message = if !self.inner.send_rate_limit_headers && !d.too_large {
            // DeepSeek-like: says nothing about the limit or when to come back.
            "Rate limit reached. Please retry later.".to_owned()
        } else if d.too_large {
            format!(
                "Request too large for {model} in organization org-{org} on {what} ({abbr}): Limit {}, Requested {}. The input or output tokens must be reduced in order to run successfully. {RATE_LIMIT_DOCS}",
                d.limit, d.requested
            )
        } else {
            format!(
                "Rate limit reached for {model} in organization org-{org} on {what} ({abbr}): Limit {}, Used {}, Requested {}. Please try again in {}. {RATE_LIMIT_DOCS}",
                d.limit,
                d.used,
                d.requested,
                go_duration(d.wait_ns)
            )
        };
        let body = ErrorBody {
            error: ErrorDetail {
                message: &message,
                kind,
                param: None,
                code: Some("rate_limit_exceeded"),
            },
        };
        let mut resp = self.json(StatusCode::TOO_MANY_REQUESTS, &body, Some(view));
        if self.inner.send_rate_limit_headers && !d.too_large {
            let h = resp.headers_mut();
            h.insert("retry-after", HeaderValue::from(ceil_secs(d.wait_ns)));
            h.insert("retry-after-ms", HeaderValue::from(d.wait_ns.div_ceil(1_000_000)));
        }
        resp
    }
}

fn rate_limit_headers(h: &mut HeaderMap, view: &LimitsView) {
    fn put(h: &mut HeaderMap, names: [&'static str; 3], b: &BucketView) {
        h.insert(HeaderName::from_static(names[0]), HeaderValue::from(b.limit));
        h.insert(HeaderName::from_static(names[1]), HeaderValue::from(b.remaining));
        if let Ok(v) = HeaderValue::from_str(&go_duration(b.reset_ns)) {
            h.insert(HeaderName::from_static(names[2]), v);
        }
    }
    if let Some(b) = view.rpm.as_ref().or(view.rpd.as_ref()) {
        put(
            h,
            [
                "x-ratelimit-limit-requests",
                "x-ratelimit-remaining-requests",
                "x-ratelimit-reset-requests",
            ],
            b,
        );
    }
    if let Some(b) = &view.tpm {
        put(
            h,
            [
                "x-ratelimit-limit-tokens",
                "x-ratelimit-remaining-tokens",
                "x-ratelimit-reset-tokens",
            ],
            b,
        );
    }
}

/// Shows a key the way OpenAI does in 401 messages: a prefix, stars, the last 4.
fn redact(key: &str) -> String {
    let chars: Vec<char> = key.chars().collect();
    if chars.len() <= 8 {
        return "*".repeat(chars.len());
    }
    let head: String = chars[..3].iter().collect();
    let tail: String = chars[chars.len() - 4..].iter().collect();
    format!("{head}{}{tail}", "*".repeat(chars.len() - 7))
}

/// Go-style duration as OpenAI sends it, rounded up to the millisecond: `0s`, `12ms`,
/// `1s`, `9.816s`, `2m59.56s`, `6m0s`, `1h2m3s`.
pub(crate) fn go_duration(ns: u64) -> String {
    let ms = ns.div_ceil(1_000_000);
    if ms == 0 {
        return "0s".to_owned();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let hours = ms / 3_600_000;
    let minutes = (ms / 60_000) % 60;
    let sec_ms = ms % 60_000;
    let mut secs = (sec_ms / 1000).to_string();
    let frac = sec_ms % 1000;
    if frac > 0 {
        let f = format!("{frac:03}");
        secs.push('.');
        secs.push_str(f.trim_end_matches('0'));
    }
    if hours > 0 {
        format!("{hours}h{minutes}m{secs}s")
    } else if minutes > 0 {
        format!("{minutes}m{secs}s")
    } else {
        format!("{secs}s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations() {
        let ms = 1_000_000;
        assert_eq!(go_duration(0), "0s");
        assert_eq!(go_duration(1), "1ms");
        assert_eq!(go_duration(12 * ms), "12ms");
        assert_eq!(go_duration(1000 * ms), "1s");
        assert_eq!(go_duration(9816 * ms), "9.816s");
        assert_eq!(go_duration(20_000 * ms), "20s");
        assert_eq!(go_duration(179_560 * ms), "2m59.56s");
        assert_eq!(go_duration(360_000 * ms), "6m0s");
        assert_eq!(go_duration(3_723_000 * ms), "1h2m3s");
        assert_eq!(go_duration(500 * ms + 1), "501ms");
    }

    #[test]
    fn redacts_keys() {
        assert_eq!(redact("sk-mock-revoked"), "sk-********oked");
        assert_eq!(redact("short"), "*****");
    }
}
